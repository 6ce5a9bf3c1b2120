// Engine::WriteSnapshot and Engine::RestoreSnapshot: the engine's state to and from a snapshot
// file (layout in snapshot_file.h).
#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/engine.h"
#include "engine/snapshot_file.h"
#include "engine/status_macros.h"

namespace indexer::engine {
namespace {

using kernels::kBlockSize;

// Pages moved between the backend and the file per backend call.
constexpr int64_t kChunkBytes = int64_t{16} << 20;

int64_t ChunkPages(const EngineConfig& config) {
  return std::max<int64_t>(1, kChunkBytes / config.BytesPerPage());
}

// What a snapshot file holds, apart from the pages' bytes.
struct SnapshotContents {
  SnapshotHeader header;
  std::vector<SnapshotSequence> sequences;
  std::vector<int32_t> page_owner;  // per page of the file: the sequence whose tenant pays
                                    // (and whose device holds it)
  uint32_t crc = 0;
  int64_t bytes = 0;
};

// FAILED_PRECONDITION listing every setting in which the file differs from `config`.
absl::Status CheckSameShape(const std::string& path, const SnapshotHeader& h,
                            const EngineConfig& config) {
  std::vector<std::string> differences;
  const auto compare = [&](const char* name, uint64_t file, uint64_t ours, auto describe) {
    if (file != ours) {
      differences.push_back(
          absl::StrCat(name, " ", describe(file), " (this server: ", describe(ours), ")"));
    }
  };
  const auto number = [](uint64_t v) { return absl::StrCat(v); };
  const auto storage = [](uint64_t v) -> std::string {
    if (v == static_cast<uint64_t>(kernels::KeyStorage::kBf16)) return "bf16";
    if (v == static_cast<uint64_t>(kernels::KeyStorage::kFp8E4M3)) return "fp8";
    if (v == static_cast<uint64_t>(kernels::KeyStorage::kFp4E2M1)) return "fp4";
    return absl::StrCat("unknown (", v, ")");
  };
  compare("head_dim", h.head_dim, static_cast<uint64_t>(config.head_dim), number);
  compare("key_dtype", h.key_storage, static_cast<uint64_t>(config.key_storage), storage);
  compare("layers", h.layers, static_cast<uint64_t>(config.layers), number);
  compare("block_size", h.block_size, static_cast<uint64_t>(kBlockSize), number);
  if (!differences.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("snapshot file ", path, " was written by a server with a different cache: ",
                     absl::StrJoin(differences, ", "),
                     "; start this server with the snapshot's settings to restore it"));
  }
  if (h.page_bytes != static_cast<uint64_t>(config.BytesPerPage())) {
    return absl::DataLossError(absl::StrCat("snapshot file ", path, " claims pages of ",
                                            h.page_bytes, " bytes where its settings make ",
                                            config.BytesPerPage()));
  }
  return absl::OkStatus();
}

// Checks what one stored sequence says against itself, the file and `config`.
absl::Status CheckSequence(const std::string& path, const SnapshotSequence& s, uint64_t num_pages,
                           const EngineConfig& config) {
  const std::string what =
      absl::StrCat("snapshot file ", path, ": sequence '", s.id, "' of ", TenantLabel(s.tenant));
  if (s.tenant.find('\0') != std::string::npos) {
    return absl::DataLossError(absl::StrCat(what, " has a tenant name holding a NUL byte"));
  }
  if (s.id.empty() || s.id.size() > 256) {
    return absl::DataLossError(absl::StrCat(what, " has an id of ", s.id.size(),
                                            " bytes; ids have 1 to 256"));
  }
  int64_t longest = 0;
  for (size_t l = 0; l < s.lengths.size(); ++l) {
    if (s.lengths[l] > config.max_tokens_per_sequence) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, " holds ", s.lengths[l], " tokens in layer ", l,
          "; this server's max_tokens_per_sequence is ", config.max_tokens_per_sequence));
    }
    longest = std::max(longest, s.lengths[l]);
  }
  const size_t blocks = static_cast<size_t>((longest + kBlockSize - 1) / kBlockSize);
  if (s.pages.size() != blocks) {
    return absl::DataLossError(absl::StrCat(what, " has ", s.pages.size(), " pages for ",
                                            longest, " tokens, which need ", blocks));
  }
  absl::flat_hash_set<uint32_t> seen;
  for (uint32_t p : s.pages) {
    if (p >= num_pages) {
      return absl::DataLossError(
          absl::StrCat(what, " uses page ", p, " of a file holding ", num_pages));
    }
    if (!seen.insert(p).second) {
      return absl::DataLossError(absl::StrCat(what, " uses page ", p, " twice"));
    }
  }
  if (s.has_attn_pages && !s.attn_decided) {
    return absl::DataLossError(absl::StrCat(what, " has attention pages it never decided on"));
  }
  if (s.attn_pages.size() != (s.has_attn_pages ? blocks : 0)) {
    return absl::DataLossError(absl::StrCat(what, " has ", s.attn_pages.size(),
                                            " attention pages for ", blocks, " blocks"));
  }
  const int64_t max_attn =
      (int64_t{std::numeric_limits<int32_t>::max()} - config.page_table.pages_per_block + 1) /
      config.page_table.block_page_stride;
  for (int32_t a : s.attn_pages) {
    if (a < 0 || a > max_attn) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, " has attention page ", a, "; with this server's page table settings ids must "
          "be in [0, ", max_attn, "]"));
    }
  }
  return absl::OkStatus();
}

// Zeroes the keys of slots [first, kBlockSize) of one layer's page.
void ClearSlotsFrom(uint8_t* layer_page, kernels::KeyStorage storage, int head_dim, int64_t first) {
  for (int slot = static_cast<int>(first); slot < kBlockSize; ++slot) {
    kernels::ClearKey(layer_page, storage, head_dim, 0, slot);
  }
}

// DATA_LOSS when a stored key is NaN or infinite (no append can store one).
absl::Status CheckFinite(const std::string& path, const uint8_t* data, int64_t bytes,
                         kernels::KeyStorage storage, int head_dim, uint64_t first_page,
                         int64_t page_bytes) {
  int64_t bad = -1;
  if (storage == kernels::KeyStorage::kBf16) {
    // bf16 exponent all ones: Inf or NaN. The high byte of each little-endian value.
    for (int64_t i = 1; i < bytes && bad < 0; i += 2) {
      if ((data[i] & 0x7Fu) == 0x7Fu && (data[i - 1] & 0x80u) != 0) bad = i;
    }
  } else if (storage == kernels::KeyStorage::kFp8E4M3) {
    for (int64_t i = 0; i < bytes && bad < 0; ++i) {
      if (!kernels::Fp8ByteIsFinite(data[i])) bad = i;  // e4m3 has no Inf; S.1111.111 is NaN
    }
  } else {
    // Every e2m1 code is finite; the scales, one layer page's last bytes, are e4m3.
    const int64_t layer_page = kernels::PageBytes(storage, head_dim);
    const int64_t scales = kernels::Fp4ScalesOffset(0, 0, head_dim);
    for (int64_t i = 0; i < bytes && bad < 0; ++i) {
      if (i % layer_page >= scales && !kernels::Fp8ByteIsFinite(data[i])) bad = i;
    }
  }
  if (bad < 0) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat("snapshot file ", path, ": page ",
                                          first_page + bad / page_bytes,
                                          " holds a key that is not finite"));
}

// Reads the whole file, checking its structure, its checksum and every sequence against
// `config` and the engine's `devices`, into *out; hands the pages to `on_pages` in chunks (first
// page index, count, bytes).
absl::Status ReadSnapshotFile(
    const std::string& path, const EngineConfig& config, int devices, SnapshotContents* out,
    const std::function<absl::Status(uint64_t, int64_t, const uint8_t*)>& on_pages) {
  absl::StatusOr<std::unique_ptr<SnapshotReader>> opened = SnapshotReader::Open(path);
  if (!opened.ok()) return opened.status();
  SnapshotReader& reader = **opened;
  SnapshotHeader& h = out->header;
  INDEXER_RETURN_IF_ERROR(reader.ReadHeader(&h));
  INDEXER_RETURN_IF_ERROR(CheckSameShape(path, h, config));
  if (devices == 1 && h.num_pages > static_cast<uint64_t>(config.capacity_pages)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("snapshot file ", path, " holds ", h.num_pages, " pages; this server's "
                     "capacity is ", config.capacity_pages, " pages: raise --capacity"));
  }
  // Sequences, each checked, and which tenant every page belongs to.
  const uint64_t max_blocks = uint64_t{1} << 28;  // past any configuration's limit
  absl::flat_hash_set<std::pair<std::string, std::string>> ids;
  out->page_owner.assign(h.num_pages, -1);
  for (uint64_t i = 0; i < h.num_sequences; ++i) {
    SnapshotSequence& s = out->sequences.emplace_back();  // grown as read: never trust a count
    INDEXER_RETURN_IF_ERROR(reader.ReadSequence(h.layers, max_blocks, &s));
    INDEXER_RETURN_IF_ERROR(CheckSequence(path, s, h.num_pages, config));
    if (!ids.insert({s.tenant, s.id}).second) {
      return absl::DataLossError(absl::StrCat("snapshot file ", path, " holds sequence '", s.id,
                                              "' of ", TenantLabel(s.tenant), " twice"));
    }
    if (s.device >= static_cast<uint32_t>(devices)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "snapshot file ", path, " places sequence '", s.id, "' of ", TenantLabel(s.tenant),
          " on device ", s.device, " of the writer's ", h.devices, "; this server has ", devices,
          " devices: start it with as many devices (--devices, --cpu_devices) to restore it"));
    }
    for (uint32_t p : s.pages) {
      int32_t& owner = out->page_owner[p];
      if (owner >= 0 && out->sequences[owner].tenant != s.tenant) {
        return absl::DataLossError(absl::StrCat("snapshot file ", path, ": page ", p,
                                                " is shared by two tenants"));
      }
      if (owner >= 0 && out->sequences[owner].device != s.device) {
        return absl::DataLossError(absl::StrCat("snapshot file ", path, ": page ", p,
                                                " is shared by sequences on two devices"));
      }
      if (owner < 0) owner = static_cast<int32_t>(i);
    }
  }
  std::vector<uint64_t> per_device(devices, 0);
  for (uint64_t p = 0; p < h.num_pages; ++p) {
    if (out->page_owner[p] < 0) {
      return absl::DataLossError(
          absl::StrCat("snapshot file ", path, ": page ", p, " belongs to no sequence"));
    }
    ++per_device[out->sequences[out->page_owner[p]].device];
  }
  for (int d = 0; d < devices; ++d) {
    if (per_device[d] > static_cast<uint64_t>(config.capacity_pages)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "snapshot file ", path, " holds ", per_device[d], " pages on device ", d,
          "; this server's capacity is ", config.capacity_pages,
          " pages per device: raise --capacity"));
    }
  }
  // Pages, in chunks.
  const int64_t chunk = ChunkPages(config);
  std::vector<uint8_t> buffer(static_cast<size_t>(chunk * h.page_bytes));
  for (uint64_t first = 0; first < h.num_pages; first += chunk) {
    const int64_t n = std::min<int64_t>(chunk, static_cast<int64_t>(h.num_pages - first));
    INDEXER_RETURN_IF_ERROR(reader.ReadPages(buffer.data(), n * h.page_bytes));
    INDEXER_RETURN_IF_ERROR(on_pages(first, n, buffer.data()));
  }
  out->crc = reader.crc();
  INDEXER_RETURN_IF_ERROR(reader.ReadTrailer());
  out->bytes = static_cast<int64_t>(reader.file_size());
  return absl::OkStatus();
}

}  // namespace

absl::Status Engine::WriteSnapshot(const std::string& path, SnapshotStats* stats) {
  CallGate::Paused paused(gate_);
  const std::vector<std::shared_ptr<Sequence>> all = core_->sequences.All();
  const int layers = core_->config.layers;

  // Distinct pages in order of first use, and per page and layer how many leading slots hold
  // keys (a page sits at the same block index in every sequence that shares it).
  absl::flat_hash_map<int32_t, uint32_t> index;
  std::vector<int32_t> pages;
  std::vector<int64_t> filled;  // [file page][layer]
  std::vector<SnapshotSequence> records(all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    const Sequence& seq = *all[i];
    std::lock_guard<SequenceMutex> lock(all[i]->mu);  // no call runs while paused; for the rule
    SnapshotSequence& r = records[i];
    r.tenant = seq.tenant;
    r.id = seq.id;
    r.device = static_cast<uint32_t>(seq.device);
    r.attn_decided = seq.attn_decided;
    r.has_attn_pages = seq.has_attn_pages;
    r.lengths = seq.lengths;
    r.attn_pages = seq.attn_pages;
    r.pages.resize(seq.pages.size());
    for (size_t b = 0; b < seq.pages.size(); ++b) {
      auto [it, inserted] = index.try_emplace(seq.pages[b], static_cast<uint32_t>(pages.size()));
      if (inserted) {
        pages.push_back(seq.pages[b]);
        filled.resize(filled.size() + layers, 0);
      }
      r.pages[b] = it->second;
      for (int l = 0; l < layers; ++l) {
        const int64_t in_block = seq.lengths[l] - static_cast<int64_t>(b) * kBlockSize;
        const int64_t slots = std::clamp<int64_t>(in_block, 0, kBlockSize);
        int64_t& f = filled[int64_t{it->second} * layers + l];
        f = std::max(f, slots);
      }
    }
  }

  absl::StatusOr<std::unique_ptr<SnapshotWriter>> created = SnapshotWriter::Create(path);
  if (!created.ok()) return created.status();
  SnapshotWriter& writer = **created;
  SnapshotHeader header;
  // One-device servers write version 1, which older servers read too.
  header.version = core_->devices.size() > 1 ? kSnapshotVersion : 1;
  header.devices = static_cast<uint32_t>(core_->devices.size());
  header.head_dim = static_cast<uint32_t>(core_->config.head_dim);
  header.layers = static_cast<uint32_t>(layers);
  header.key_storage = static_cast<uint32_t>(core_->config.key_storage);
  header.block_size = static_cast<uint32_t>(kBlockSize);
  header.page_bytes = static_cast<uint64_t>(core_->config.BytesPerPage());
  header.num_pages = pages.size();
  header.num_sequences = records.size();
  INDEXER_RETURN_IF_ERROR(writer.WriteHeader(header));
  for (const SnapshotSequence& r : records) INDEXER_RETURN_IF_ERROR(writer.WriteSequence(r));

  // Slots past every sequence's length hold whatever the page held before: zero them, so the
  // file holds keys only (and the same state always gives the same file).
  const int64_t page_bytes = core_->config.BytesPerPage();
  const int64_t layer_page_bytes = page_bytes / layers;
  const int64_t chunk = ChunkPages(core_->config);
  std::vector<uint8_t> buffer(static_cast<size_t>(chunk * page_bytes));
  for (size_t first = 0; first < pages.size(); first += chunk) {
    const int64_t n = std::min<int64_t>(chunk, static_cast<int64_t>(pages.size() - first));
    INDEXER_RETURN_IF_ERROR(
        ReadPagesAnyDevice(std::span<const int32_t>(pages.data() + first, n), buffer.data()));
    for (int64_t j = 0; j < n; ++j) {
      for (int l = 0; l < layers; ++l) {
        uint8_t* layer_page = buffer.data() + (j * layers + l) * layer_page_bytes;
        const int64_t f = filled[(static_cast<int64_t>(first) + j) * layers + l];
        ClearSlotsFrom(layer_page, core_->config.key_storage, core_->config.head_dim, f);
      }
    }
    INDEXER_RETURN_IF_ERROR(writer.WritePages(buffer.data(), n * page_bytes));
  }
  INDEXER_RETURN_IF_ERROR(writer.Commit());
  if (stats != nullptr) {
    *stats = SnapshotStats{static_cast<int64_t>(records.size()),
                           static_cast<int64_t>(pages.size()),
                           static_cast<int64_t>(writer.bytes_written())};
  }
  return absl::OkStatus();
}

absl::Status Engine::RestoreSnapshot(const std::string& path, SnapshotStats* stats) {
  CallGate::Paused paused(gate_);
  if (core_->sequences.size() != 0 || core_->pool.free_pages() != core_->pool.total_pages()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot restore ", path, ": the engine already holds ", core_->sequences.size(),
        " sequences; a snapshot is restored into an empty server"));
  }

  // Pass 1: check everything, pages included, before anything is applied.
  SnapshotContents plan;
  const int devices = num_devices();
  INDEXER_RETURN_IF_ERROR(ReadSnapshotFile(
      path, core_->config, devices, &plan, [&](uint64_t first, int64_t n, const uint8_t* data) {
        return CheckFinite(path, data, n * core_->config.BytesPerPage(), core_->config.key_storage,
                           core_->config.head_dim, first, core_->config.BytesPerPage());
      }));

  if (core_->config.max_sequences > 0 &&
      static_cast<int64_t>(plan.sequences.size()) > core_->config.max_sequences) {
    return absl::FailedPreconditionError(absl::StrCat(
        "snapshot file ", path, " holds ", plan.sequences.size(),
        " sequences; this server's max_sequences is ", core_->config.max_sequences));
  }
  if (const int64_t limit = core_->config.tenant_max_sequences; limit > 0) {
    absl::flat_hash_map<absl::string_view, int64_t> per_tenant;
    for (const SnapshotSequence& r : plan.sequences) {
      if (++per_tenant[r.tenant] > limit) {
        return absl::FailedPreconditionError(absl::StrCat(
            "snapshot file ", path, " holds more than ", limit, " sequences of tenant '",
            r.tenant, "'; this server's tenant_max_sequences is ", limit));
      }
    }
  }

  // Pass 2: take the pages (charged to their tenants), load them, and make sure the file still
  // says what pass 1 read. Sequences appear only after that, so a failure leaves nothing behind.
  const uint64_t num_pages = plan.header.num_pages;
  std::vector<int32_t> page_of(num_pages, -1);  // file page -> pool page
  std::vector<int32_t> taken;
  // Pages are taken per tenant (who pays) and device (the one their sequences were on).
  absl::flat_hash_map<std::pair<std::string, uint32_t>, std::vector<uint64_t>> by_owner;
  for (uint64_t p = 0; p < num_pages; ++p) {
    const SnapshotSequence& owner = plan.sequences[plan.page_owner[p]];
    by_owner[{owner.tenant, owner.device}].push_back(p);
  }
  absl::Status status;
  for (const auto& [owner, file_pages] : by_owner) {
    absl::StatusOr<std::vector<int32_t>> got =
        core_->pool.Allocate(static_cast<int64_t>(file_pages.size()), owner.first,
                       /*enforce_quota=*/false, static_cast<int>(owner.second));
    if (!got.ok()) {
      status = got.status();
      break;
    }
    for (size_t i = 0; i < file_pages.size(); ++i) page_of[file_pages[i]] = (*got)[i];
    taken.insert(taken.end(), got->begin(), got->end());
  }
  SnapshotContents again;
  if (status.ok()) {
    status = ReadSnapshotFile(path, core_->config, devices, &again,
                              [&](uint64_t first, int64_t n, const uint8_t* data) {
                                return WritePagesAnyDevice(
                                    std::span<const int32_t>(page_of.data() + first, n), data);
                              });
  }
  if (status.ok() && (again.crc != plan.crc || again.sequences.size() != plan.sequences.size() ||
                      !std::equal(again.sequences.begin(), again.sequences.end(),
                                  plan.sequences.begin()))) {
    status = absl::AbortedError(
        absl::StrCat("snapshot file ", path, " changed while it was being restored"));
  }
  if (!status.ok()) {
    core_->pool.Release(taken);
    return status;
  }

  // Every pool page came with one reference; sequences sharing it take one more each.
  std::vector<bool> first_use(num_pages, true);
  for (const SnapshotSequence& r : plan.sequences) {
    auto seq = std::make_shared<Sequence>(r.tenant, r.id, core_->config.layers, static_cast<int>(r.device));
    seq->lengths = r.lengths;
    seq->attn_decided = r.attn_decided;
    seq->has_attn_pages = r.has_attn_pages;
    seq->attn_pages = r.attn_pages;
    seq->pages.resize(r.pages.size());
    for (size_t b = 0; b < r.pages.size(); ++b) {
      seq->pages[b] = page_of[r.pages[b]];
      if (!first_use[r.pages[b]]) core_->pool.AddRef(std::span<const int32_t>(&seq->pages[b], 1));
      first_use[r.pages[b]] = false;
    }
    core_->sequences.Insert(std::move(seq));  // ids were checked distinct
  }
  if (stats != nullptr) {
    *stats = SnapshotStats{static_cast<int64_t>(plan.sequences.size()),
                           static_cast<int64_t>(num_pages), plan.bytes};
  }
  return absl::OkStatus();
}

}  // namespace indexer::engine
