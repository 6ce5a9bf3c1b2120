// Soak: many concurrent clients against the real indexer-server, for as long as
// INDEXER_SOAK_SECONDS says (default 60), mixing appends, selections (unary, Batch, BatchStream),
// forks, truncations and releases, with deadlines short enough to cancel calls in flight,
// streams dropped mid-call, client processes killed mid-stream, bad requests, and one client
// that keeps exhausting the page pool. Every answer is checked against the reference selector
// (keys and queries are small integers, so the answers are exact, ties included).
//
// Afterwards: every surviving sequence is exactly what its owner's model says (lengths,
// attention pages), the pages in use are exactly the distinct pages of the survivors (sharing
// counted right), every survivor still selects what the reference says, releasing them returns
// every page, the server's resident memory shows no growth after warm-up, and SIGTERM stops it
// with exit status 0. The figures are printed; docs/ROBUSTNESS.md has a long run's.
//
// Outcomes a client cannot know (its deadline passed, or it dropped a stream or connection, with
// a call in flight) are settled by asking the server (GetSequence) once the server has had time
// to finish what it started (INDEXER_SOAK_SETTLE_MS, default 300): the change happened completely
// or not at all, and the model follows. Until then the worker leaves that sequence alone.
#include <signal.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/cpp/indexer_client.h"
#include "kernels/numeric.h"
#include "tests/testing/child_process.h"
#include "tests/testing/server_fixture.h"

namespace indexer::testing {
namespace {

using client::BatchStream;
using client::CallOptions;
using client::IndexerClient;
using client::Selection;

// The server under test: small, so that the pool and the sequence limit are reached often.
constexpr int kHeadDim = 64;
constexpr int kLayers = 2;
constexpr int kCapacityPages = 160;
constexpr int kMaxSequences = 64;
constexpr int kMaxTokens = 4096;
constexpr int kMaxTopk = 16;
constexpr int kMaxHeads = 4;
const kernels::PageTableParams kPageTable{4, 8};
constexpr int kWorkers = 6;
// Sequences a worker keeps and how long it lets them grow.
constexpr size_t kSequencesPerWorker = 6;
constexpr int64_t kLongSequence = 600;

double SoakSeconds() {
  const char* v = std::getenv("INDEXER_SOAK_SECONDS");
  return v != nullptr ? std::max(5.0, std::atof(v)) : 60.0;
}

// How long a call the client gave up on may still run in the server: a handler that passed its
// deadline check just before the deadline still applies its step, possibly after the client's
// next call. Sanitizer builds run slower and set more.
absl::Duration SettleTime() {
  const char* v = std::getenv("INDEXER_SOAK_SETTLE_MS");
  return absl::Milliseconds(v != nullptr ? std::max(10, std::atoi(v)) : 300);
}

int64_t BlocksFor(int64_t tokens) { return (tokens + kernels::kBlockSize - 1) / kernels::kBlockSize; }

// A sequence as its owner knows it: the keys it appended (and the attention pages).
struct Owned {
  Owned() : host(kLayers, kHeadDim) {}
  HostSequence host;
  bool attn = false;  // created with attention pages

  int64_t MaxLength() const { return std::max(host.length(0), host.length(1)); }
  std::vector<uint32_t> Lengths() const {
    return {static_cast<uint32_t>(host.length(0)), static_cast<uint32_t>(host.length(1))};
  }
};

// An append whose outcome may be unknown: what it carried.
struct PendingAppend {
  std::string id;
  int layer = -1;  // -1: every layer ([n][layers][head_dim])
  std::vector<float> keys;
  std::vector<int32_t> attn;

  int64_t tokens() const {
    return static_cast<int64_t>(keys.size()) / (kHeadDim * (layer < 0 ? kLayers : 1));
  }
  void ApplyTo(Owned* o) const {
    if (layer < 0) {
      o->host.AppendAllLayers(keys);
    } else {
      o->host.Append(layer, keys);
    }
    o->host.attention_pages.insert(o->host.attention_pages.end(), attn.begin(), attn.end());
  }
  std::vector<uint32_t> LengthsAfter(const Owned& o) const {
    std::vector<uint32_t> l = o.Lengths();
    for (int i = 0; i < kLayers; ++i) {
      if (layer < 0 || layer == i) l[i] += static_cast<uint32_t>(tokens());
    }
    return l;
  }
};

// Counts of every call's outcome, by operation and status code, and the checks made.
class Tally {
 public:
  void Add(absl::string_view op, absl::StatusCode code) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[absl::StrCat(op, " ", absl::StatusCodeToString(code))];
  }
  std::string Report() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::string out;
    for (const auto& [what, n] : counts_) absl::StrAppend(&out, "  ", what, ": ", n, "\n");
    return out;
  }
  int64_t Total() const {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t total = 0;
    for (const auto& [what, n] : counts_) total += n;
    return total;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, int64_t> counts_;
};

// What every thread shares.
struct Shared {
  int port = 0;
  absl::Time end;
  Tally tally;
  std::atomic<int64_t> verified{0};        // selection answers checked against the reference
  std::atomic<int64_t> resynced{0};        // unknown outcomes settled by asking the server
  std::atomic<int64_t> exhausted{0};       // RESOURCE_EXHAUSTED answers
  std::atomic<int> failures{0};
  // Forks handed from one worker to another, by receiving worker.
  std::mutex mailbox_mu;
  std::vector<std::vector<std::pair<std::string, Owned>>> mailbox =
      std::vector<std::vector<std::pair<std::string, Owned>>>(kWorkers);

  // A check failed: the test fails (the first messages are shown; the rest only counted).
  void Fail(const std::string& what) {
    if (failures.fetch_add(1) < 20) ADD_FAILURE() << what;
  }
  bool Running() const { return absl::Now() < end; }
};

std::string Target(int port) { return absl::StrCat("127.0.0.1:", port); }

std::unique_ptr<IndexerClient> Connect(int port, bool own_connection = false) {
  if (!own_connection) {
    absl::StatusOr<std::unique_ptr<IndexerClient>> c = IndexerClient::Connect(Target(port));
    return c.ok() ? std::move(*c) : nullptr;
  }
  // A channel with its own subchannel pool has its own TCP connection, which closes with it.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetMaxReceiveMessageSize(64 << 20);
  return std::make_unique<IndexerClient>(
      grpc::CreateCustomChannel(Target(port), grpc::InsecureChannelCredentials(), args));
}

// Exact comparison of an answer with the reference; *why says the first difference.
bool SameSelection(const Selection& got, const Selection& want, std::string* why) {
  if (got.num_tokens != want.num_tokens || got.num_heads != want.num_heads ||
      got.topk != want.topk || got.start_position != want.start_position) {
    *why = absl::StrCat("shape ", got.num_tokens, "x", got.num_heads, "x", got.topk, " from ",
                        got.start_position, "; the reference's ", want.num_tokens, "x",
                        want.num_heads, "x", want.topk, " from ", want.start_position);
    return false;
  }
  if (got.block_ids != want.block_ids) {
    *why = "block ids differ";
    return false;
  }
  if (got.page_table != want.page_table || got.context_lens != want.context_lens) {
    *why = "page table rows differ";
    return false;
  }
  return true;
}

// One client thread: owns up to kSequencesPerWorker sequences and runs random operations on
// them until the time is up.
class Worker {
 public:
  Worker(int index, Shared* shared, uint32_t seed)
      : index_(index), shared_(shared), rng_(seed), client_(Connect(shared->port)) {}

  void Run() {
    while (shared_->Running() && shared_->failures.load() < 20) {
      TakeMail();
      Settle(/*all=*/false);
      const int dice = Uniform(0, 99);
      const size_t available = Available().size();
      if (available < 2 && seqs_.size() >= kSequencesPerWorker) {
        absl::SleepFor(absl::Milliseconds(5));  // the rest are being settled
        if (available == 0) continue;
      }
      if (available < 2 || (dice < 8 && seqs_.size() < kSequencesPerWorker)) {
        Create();
      } else if (dice < 27) {
        Append();
      } else if (dice < 50) {
        DecodeStep();
      } else if (dice < 63) {
        BatchStep();
      } else if (dice < 72) {
        StreamSteps();
      } else if (dice < 77) {
        Fork();
      } else if (dice < 82) {
        Truncate();
      } else if (dice < 86) {
        Release(PickId());
      } else if (dice < 90) {
        ShortDeadline();
      } else if (dice < 93) {
        DropConnection();
      } else {
        BadRequest();
      }
    }
    Settle(/*all=*/true);
  }

  std::map<std::string, Owned>& sequences() { return seqs_; }

 private:
  int Uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  std::vector<float> Ints(size_t n) { return IntValues(rng_, n); }

  // The sequences not waiting to be settled.
  std::vector<std::string> Available() const {
    std::vector<std::string> ids;
    for (const auto& [id, o] : seqs_) {
      if (unsure_.count(id) == 0) ids.push_back(id);
    }
    return ids;
  }
  std::string PickId() {
    const std::vector<std::string> ids = Available();
    return ids[Uniform(0, static_cast<int>(ids.size()) - 1)];
  }

  // `id`'s state is unknown until the server has finished what `p` (or nothing) started.
  void Unsure(const std::string& id, const PendingAppend* p) {
    unsure_[id] = Unsettled{p != nullptr ? std::optional<PendingAppend>(*p) : std::nullopt,
                            absl::Now() + SettleTime()};
  }
  // Settles the sequences whose time has come (all: every one, waiting as needed).
  void Settle(bool all) {
    for (auto it = unsure_.begin(); it != unsure_.end();) {
      const absl::Time now = absl::Now();
      if (!all && it->second.ready > now) {
        ++it;
        continue;
      }
      if (it->second.ready > now) absl::SleepFor(it->second.ready - now);
      Resync(it->first, it->second.pending ? &*it->second.pending : nullptr);
      it = unsure_.erase(it);
    }
  }
  std::string NewId() { return absl::StrCat("w", index_, "-", next_id_++); }

  // Records the outcome; false (and a test failure) when `code` is not one of `allowed`.
  bool Expect(absl::string_view op, const absl::Status& s,
              std::initializer_list<absl::StatusCode> allowed) {
    shared_->tally.Add(op, s.code());
    if (s.code() == absl::StatusCode::kResourceExhausted) ++shared_->exhausted;
    for (absl::StatusCode c : allowed) {
      if (s.code() == c) return true;
    }
    shared_->Fail(absl::StrCat("worker ", index_, " ", op, ": unexpected ", s.ToString()));
    return false;
  }

  // An append of `tokens` tokens to `id` (one layer, or every layer when layer < 0), with the
  // attention page ids it needs when the sequence has attention pages.
  PendingAppend MakeAppend(const std::string& id, int layer, int64_t tokens, bool new_with_attn) {
    PendingAppend p;
    p.id = id;
    p.layer = layer;
    p.keys = Ints(static_cast<size_t>(tokens) * kHeadDim * (layer < 0 ? kLayers : 1));
    auto it = seqs_.find(id);
    const bool attn = it != seqs_.end() ? it->second.attn : new_with_attn;
    if (attn) {
      const int64_t before = it != seqs_.end() ? it->second.MaxLength() : 0;
      int64_t after = before;
      if (it != seqs_.end()) {
        const std::vector<uint32_t> l = p.LengthsAfter(it->second);
        after = *std::max_element(l.begin(), l.end());
      } else {
        after = tokens;
      }
      for (int64_t b = BlocksFor(before); b < BlocksFor(after); ++b) p.attn.push_back(Uniform(0, 1 << 20));
    }
    return p;
  }

  v1::AppendKeysRequest ToRequest(const PendingAppend& p, bool with_id = true) {
    v1::AppendKeysRequest r = p.layer < 0 ? client::MakeAppendAllLayers(with_id ? p.id : "", p.keys)
                                          : client::MakeAppend(with_id ? p.id : "", p.layer, p.keys);
    for (int32_t a : p.attn) r.add_attention_pages(a);
    return r;
  }

  // Settles an unknown outcome of `p` (null: a call that appended nothing to `id`) by asking the
  // server; the model follows what it says.
  void Resync(const std::string& id, const PendingAppend* p) {
    ++shared_->resynced;
    absl::StatusOr<v1::GetSequenceResponse> got =
        client_->GetSequence(id, CallOptions::Timeout(absl::Seconds(30)));
    auto it = seqs_.find(id);
    if (!got.ok()) {
      if (got.status().code() != absl::StatusCode::kNotFound) {
        shared_->Fail(absl::StrCat("resync of ", id, ": ", got.status().ToString()));
      } else if (it != seqs_.end()) {
        shared_->Fail(absl::StrCat("resync: sequence ", id, " vanished"));
        seqs_.erase(it);
      }
      return;  // never created
    }
    const std::vector<uint32_t> lengths(got->lengths().begin(), got->lengths().end());
    if (it == seqs_.end()) {
      Owned created;
      if (p != nullptr) {
        created.attn = !p->attn.empty();
        p->ApplyTo(&created);
      }
      if (lengths != created.Lengths()) {
        shared_->Fail(absl::StrCat("resync: ", id, " exists with unexpected lengths"));
        return;
      }
      seqs_.emplace(id, std::move(created));
      return;
    }
    if (lengths == it->second.Lengths()) return;  // not applied
    if (p != nullptr && lengths == p->LengthsAfter(it->second)) {
      p->ApplyTo(&it->second);
      return;
    }
    shared_->Fail(absl::StrCat("resync: ", id, " has lengths that are neither before nor after"));
  }

  // Checks a selection answer against the reference on the model.
  void Verify(const std::string& id, int layer, const std::vector<float>& queries, int heads,
              const kernels::SelectParams& params, const Selection& got) {
    const Owned& o = seqs_.at(id);
    const int64_t n = static_cast<int64_t>(queries.size()) / (int64_t{heads} * kHeadDim);
    const int64_t p0 = o.host.length(layer) - n;
    const Selection want = o.host.Select(layer, queries, heads, p0, params, kPageTable);
    std::string why;
    if (!SameSelection(got, want, &why)) {
      shared_->Fail(absl::StrCat("worker ", index_, ": selection on ", id, " layer ", layer,
                                 " differs from the reference: ", why));
    }
    if (got.lengths != o.Lengths()) shared_->Fail(absl::StrCat(id, ": answer's lengths differ"));
    ++shared_->verified;
  }

  // A selection request of `n` tokens ending at the last token, with random parameters.
  v1::SelectBlocksRequest MakeSelect(const std::string& id, int layer, int n, int heads,
                                     std::vector<float>* queries, kernels::SelectParams* params) {
    *queries = Ints(static_cast<size_t>(n) * heads * kHeadDim);
    v1::SelectBlocksRequest r = client::MakeSelect(id, layer, heads, *queries);
    *params = kernels::SelectParams{Uniform(1, kMaxTopk), Uniform(0, 2), Uniform(0, 2)};
    r.set_topk(params->topk);
    r.set_init_blocks(params->init_blocks);
    r.set_local_blocks(params->local_blocks);
    return r;
  }

  void RunAppend(const PendingAppend& p, absl::string_view op) {
    absl::StatusOr<v1::AppendKeysResponse> r = client_->AppendKeys(ToRequest(p));
    if (!Expect(op, r.status(), {absl::StatusCode::kOk, absl::StatusCode::kResourceExhausted})) return;
    if (!r.ok()) {
      OnExhausted();
      return;
    }
    auto it = seqs_.find(p.id);
    if (it == seqs_.end()) {
      it = seqs_.emplace(p.id, Owned()).first;
      it->second.attn = !p.attn.empty();
    }
    p.ApplyTo(&it->second);
    if (std::vector<uint32_t>(r->lengths().begin(), r->lengths().end()) != it->second.Lengths()) {
      shared_->Fail(absl::StrCat(p.id, ": AppendKeys answered other lengths"));
    }
  }

  // Under pool pressure, give some back now and then.
  void OnExhausted() {
    const std::vector<std::string> ids = Available();
    if (!ids.empty() && Uniform(0, 2) == 0) {
      std::string longest = ids[0];
      for (const std::string& id : ids) {
        if (seqs_.at(id).MaxLength() > seqs_.at(longest).MaxLength()) longest = id;
      }
      Release(longest);
    }
  }

  void Create() {
    const std::string id = NewId();
    RunAppend(MakeAppend(id, -1, Uniform(1, 300), Uniform(0, 1) == 1), "create");
    // A full server: back off a little, as a scheduler would, rather than spin.
    if (seqs_.count(id) == 0) absl::SleepFor(absl::Milliseconds(Uniform(1, 10)));
  }

  void Append() {
    const std::string id = PickId();
    if (seqs_.at(id).MaxLength() > kLongSequence) {
      Truncate(id);
      return;
    }
    const int layer = Uniform(-1, kLayers - 1);
    RunAppend(MakeAppend(id, layer, Uniform(1, 200), false), "append");
  }

  // One decode step: the new token's key (every layer) and its queries, in one SelectBlocks.
  void DecodeStep(std::optional<absl::Duration> timeout = std::nullopt) {
    const std::string id = PickId();
    const int layer = Uniform(0, kLayers - 1);
    const int heads = Uniform(1, kMaxHeads);
    const PendingAppend p = MakeAppend(id, -1, 1, false);
    std::vector<float> q;
    kernels::SelectParams params;
    v1::SelectBlocksRequest r = MakeSelect(id, layer, 1, heads, &q, &params);
    *r.mutable_append() = ToRequest(p, /*with_id=*/false);
    const absl::StatusOr<Selection> got =
        client_->Select(r, timeout ? CallOptions::Timeout(*timeout) : CallOptions());
    const char* op = timeout ? "decode (short deadline)" : "decode";
    if (timeout) {
      if (!Expect(op, got.status(), {absl::StatusCode::kOk, absl::StatusCode::kResourceExhausted,
                                     absl::StatusCode::kDeadlineExceeded,
                                     absl::StatusCode::kCancelled})) {
        return;
      }
      if (got.status().code() == absl::StatusCode::kDeadlineExceeded ||
          got.status().code() == absl::StatusCode::kCancelled) {
        Unsure(id, &p);
        return;
      }
    } else if (!Expect(op, got.status(), {absl::StatusCode::kOk, absl::StatusCode::kResourceExhausted})) {
      return;
    }
    if (!got.ok()) {
      OnExhausted();
      return;
    }
    p.ApplyTo(&seqs_.at(id));
    Verify(id, layer, q, heads, params, *got);
  }

  // Items over distinct sequences: each appends a token (or not) and selects 1 to 3 tokens.
  struct StepItem {
    std::string id;
    int layer = 0, heads = 1;
    std::optional<PendingAppend> append;
    std::vector<float> queries;
    kernels::SelectParams params;
  };
  std::vector<StepItem> MakeItems(v1::BatchRequest* req) {
    std::vector<std::string> ids = Available();
    std::shuffle(ids.begin(), ids.end(), rng_);
    ids.resize(std::min<size_t>(ids.size(), Uniform(1, 4)));
    std::vector<StepItem> items;
    for (const std::string& id : ids) {
      StepItem it;
      it.id = id;
      it.layer = Uniform(0, kLayers - 1);
      it.heads = Uniform(1, kMaxHeads);
      if (Uniform(0, 3) > 0) it.append = MakeAppend(id, -1, 1, false);
      const int64_t len = seqs_.at(id).host.length(it.layer) + (it.append ? 1 : 0);
      const int n = static_cast<int>(std::min<int64_t>(len, Uniform(1, 3)));
      if (n < 1) continue;
      v1::SelectBlocksRequest* r = req->add_items();
      *r = MakeSelect(id, it.layer, n, it.heads, &it.queries, &it.params);
      if (it.append) *r->mutable_append() = ToRequest(*it.append, false);
      items.push_back(std::move(it));
    }
    return items;
  }

  void CheckItems(const std::vector<StepItem>& items, const v1::BatchResponse& resp,
                  absl::string_view op) {
    if (resp.results_size() != static_cast<int>(items.size())) {
      shared_->Fail(absl::StrCat(op, ": ", resp.results_size(), " results for ", items.size()));
      return;
    }
    for (size_t i = 0; i < items.size(); ++i) {
      const absl::Status s = client::ItemStatus(resp.results(static_cast<int>(i)));
      if (!Expect(op, s, {absl::StatusCode::kOk, absl::StatusCode::kResourceExhausted})) continue;
      if (!s.ok()) continue;
      if (items[i].append) items[i].append->ApplyTo(&seqs_.at(items[i].id));
      absl::StatusOr<Selection> got = client::ParseSelection(resp.results(static_cast<int>(i)).result());
      if (!got.ok()) {
        shared_->Fail(absl::StrCat(op, ": unparsable answer: ", got.status().ToString()));
        continue;
      }
      Verify(items[i].id, items[i].layer, items[i].queries, items[i].heads, items[i].params, *got);
    }
  }

  void BatchStep() {
    v1::BatchRequest req;
    req.set_request_id(Uniform(0, 1 << 30));
    const std::vector<StepItem> items = MakeItems(&req);
    if (items.empty()) return;
    absl::StatusOr<v1::BatchResponse> resp = client_->Batch(req);
    if (!Expect("batch call", resp.status(), {absl::StatusCode::kOk})) return;
    if (resp->request_id() != req.request_id()) shared_->Fail("Batch did not echo request_id");
    CheckItems(items, *resp, "batch item");
  }

  // A few steps over one BatchStream; sometimes the stream is dropped with a step in flight.
  void StreamSteps() {
    std::unique_ptr<BatchStream> stream = client_->OpenBatchStream();
    const int steps = Uniform(1, 5);
    const bool drop = Uniform(0, 3) == 0;
    for (int s = 0; s < steps; ++s) {
      v1::BatchRequest req;
      req.set_request_id(s);
      const std::vector<StepItem> items = MakeItems(&req);
      if (items.empty()) break;
      if (drop && s == steps - 1) {
        const bool written = stream->Write(req);
        if (Uniform(0, 1) == 1) absl::SleepFor(absl::Microseconds(Uniform(0, 2000)));
        stream.reset();  // cancels the call, whatever the server is doing with the step
        shared_->tally.Add("stream dropped mid-step", absl::StatusCode::kCancelled);
        for (const StepItem& it : items) Unsure(it.id, written && it.append ? &*it.append : nullptr);
        return;
      }
      absl::StatusOr<v1::BatchResponse> resp = stream->Step(req);
      if (!Expect("stream step", resp.status(), {absl::StatusCode::kOk})) return;
      if (resp->request_id() != static_cast<uint64_t>(s)) shared_->Fail("stream answers out of order");
      CheckItems(items, *resp, "stream item");
    }
    Expect("stream finish", stream->Finish(), {absl::StatusCode::kOk});
  }

  // A client that disappears: its own connection, a stream, a step written, then everything
  // (stream, channel, connection) dropped at once.
  void DropConnection() {
    std::unique_ptr<IndexerClient> own = Connect(shared_->port, /*own_connection=*/true);
    std::unique_ptr<BatchStream> stream = own->OpenBatchStream();
    v1::BatchRequest req;
    const std::vector<StepItem> items = MakeItems(&req);
    const bool written = !items.empty() && stream->Write(req);
    absl::SleepFor(absl::Microseconds(Uniform(0, 3000)));
    stream.reset();
    own.reset();
    shared_->tally.Add("connection dropped", absl::StatusCode::kUnavailable);
    for (const StepItem& it : items) Unsure(it.id, written && it.append ? &*it.append : nullptr);
  }

  void ShortDeadline() {
    if (Uniform(0, 1) == 0) {
      DecodeStep(absl::Microseconds(Uniform(1, 3000)));
      return;
    }
    const std::string id = PickId();
    const PendingAppend p = MakeAppend(id, Uniform(-1, kLayers - 1), Uniform(1, 64), false);
    absl::StatusOr<v1::AppendKeysResponse> r =
        client_->AppendKeys(ToRequest(p), CallOptions::Timeout(absl::Microseconds(Uniform(1, 3000))));
    if (!Expect("append (short deadline)", r.status(),
                {absl::StatusCode::kOk, absl::StatusCode::kResourceExhausted,
                 absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kCancelled})) {
      return;
    }
    if (r.ok()) {
      p.ApplyTo(&seqs_.at(id));
    } else if (r.status().code() != absl::StatusCode::kResourceExhausted) {
      Unsure(id, &p);
    }
  }

  void Fork() {
    const std::string source = PickId();
    const std::string target = NewId();
    Owned copy = seqs_.at(source);
    std::optional<uint32_t> length;
    if (Uniform(0, 1) == 1) {
      length = static_cast<uint32_t>(Uniform(0, static_cast<int>(copy.MaxLength())));
      copy.host.Truncate(*length);
    }
    absl::StatusOr<v1::ForkSequenceResponse> r = client_->ForkSequence(source, target, length);
    if (!Expect("fork", r.status(), {absl::StatusCode::kOk, absl::StatusCode::kResourceExhausted})) return;
    if (!r.ok()) return;  // the sequence limit
    if (std::vector<uint32_t>(r->lengths().begin(), r->lengths().end()) != copy.Lengths()) {
      shared_->Fail(absl::StrCat("fork ", target, ": unexpected lengths"));
    }
    // Half the forks go to another worker, so that two threads write sequences sharing pages.
    const int to = Uniform(0, kWorkers - 1);
    if (to != index_ && Uniform(0, 1) == 1) {
      std::lock_guard<std::mutex> lock(shared_->mailbox_mu);
      shared_->mailbox[to].emplace_back(target, std::move(copy));
    } else {
      seqs_.emplace(target, std::move(copy));
    }
    for (const std::string& id : Available()) {
      if (seqs_.size() <= kSequencesPerWorker) break;
      if (id != target) Release(id);
    }
  }

  void TakeMail() {
    std::lock_guard<std::mutex> lock(shared_->mailbox_mu);
    for (auto& [id, o] : shared_->mailbox[index_]) seqs_.emplace(id, std::move(o));
    shared_->mailbox[index_].clear();
  }

  void Truncate(std::string id = "") {
    if (id.empty()) id = PickId();
    Owned& o = seqs_.at(id);
    const uint32_t length = static_cast<uint32_t>(Uniform(0, static_cast<int>(o.MaxLength())));
    absl::StatusOr<v1::TruncateSequenceResponse> r = client_->TruncateSequence(id, length);
    if (!Expect("truncate", r.status(), {absl::StatusCode::kOk})) return;
    o.host.Truncate(length);
    if (std::vector<uint32_t>(r->lengths().begin(), r->lengths().end()) != o.Lengths()) {
      shared_->Fail(absl::StrCat("truncate ", id, ": unexpected lengths"));
    }
  }

  void Release(const std::string& id) {
    absl::StatusOr<v1::ReleaseSequenceResponse> r = client_->ReleaseSequence(id);
    if (Expect("release", r.status(), {absl::StatusCode::kOk})) seqs_.erase(id);
  }

  // Requests the server must refuse, each with its code; they change nothing (the next checked
  // selection on the sequence would show it).
  void BadRequest() {
    const std::string id = PickId();
    std::vector<float> q;
    kernels::SelectParams params;
    v1::SelectBlocksRequest r = MakeSelect(id, 0, 1, 1, &q, &params);
    absl::StatusCode want = absl::StatusCode::kInvalidArgument;
    switch (Uniform(0, 6)) {
      case 0: {
        PendingAppend p = MakeAppend(id, -1, 2, false);
        p.keys[Uniform(0, static_cast<int>(p.keys.size()) - 1)] = std::nanf("");
        *r.mutable_append() = ToRequest(p, false);
        break;
      }
      case 1: r.set_layer(kLayers + Uniform(0, 5)); break;
      case 2: r.set_topk(kMaxTopk + Uniform(1, 1000)); break;
      case 3: r.set_num_heads(0); break;
      case 4: r.mutable_queries()->pop_back(); break;
      case 5:
        r.set_start_position(seqs_.at(id).host.length(0) + Uniform(0, 100));
        want = absl::StatusCode::kFailedPrecondition;
        break;
      default:
        r.set_sequence_id(absl::StrCat("w", index_, "-never-", Uniform(0, 1 << 20)));
        want = absl::StatusCode::kNotFound;
        break;
    }
    Expect("bad request", client_->Select(r).status(), {want});
  }

  const int index_;
  Shared* const shared_;
  std::mt19937 rng_;
  std::unique_ptr<IndexerClient> client_;
  std::map<std::string, Owned> seqs_;
  struct Unsettled {
    std::optional<PendingAppend> pending;  // what the call in doubt carried (nothing: no append)
    absl::Time ready;                      // when the server is surely done with it
  };
  std::map<std::string, Unsettled> unsure_;
  int next_id_ = 0;
};

// Fills the pool again and again: appends big chunks to sequences of its own until the server
// answers RESOURCE_EXHAUSTED, checks that a full server still answers selections exactly, then
// lets everything go.
void HogLoop(Shared* shared, std::map<std::string, Owned>* kept) {
  std::mt19937 rng(4242);
  std::unique_ptr<IndexerClient> c = Connect(shared->port);
  for (int round = 0; shared->Running() && shared->failures.load() < 20; ++round) {
    std::map<std::string, Owned> mine;
    bool full = false;
    for (int k = 0; k < 16 && !full && shared->Running(); ++k) {
      const std::string id = absl::StrCat("hog-", round, "-", k);
      Owned o;
      while (o.MaxLength() + 256 <= kMaxTokens) {
        const std::vector<float> keys = IntValues(rng, size_t{256} * kLayers * kHeadDim);
        const absl::StatusOr<v1::AppendKeysResponse> r =
            c->AppendKeys(client::MakeAppendAllLayers(id, keys));
        shared->tally.Add("hog append", r.status().code());
        if (!r.ok()) {
          if (r.status().code() != absl::StatusCode::kResourceExhausted) {
            shared->Fail(absl::StrCat("hog append: ", r.status().ToString()));
          }
          ++shared->exhausted;
          full = true;
          break;
        }
        o.host.AppendAllLayers(keys);
      }
      if (o.MaxLength() > 0) mine.emplace(id, std::move(o));
    }
    if (!mine.empty()) {
      const auto& [id, o] = *mine.rbegin();
      const std::vector<float> q = IntValues(rng, size_t{2} * kHeadDim);
      const kernels::SelectParams params{8, 1, 1};
      v1::SelectBlocksRequest req = client::MakeSelect(id, 1, 2, q);
      req.set_topk(params.topk);
      req.set_init_blocks(params.init_blocks);
      req.set_local_blocks(params.local_blocks);
      const absl::StatusOr<Selection> got = c->Select(req);
      shared->tally.Add("hog select", got.status().code());
      if (!got.ok()) {
        shared->Fail(absl::StrCat("hog select on a full pool: ", got.status().ToString()));
      } else {
        std::string why;
        if (!SameSelection(*got, o.host.Select(1, q, 2, o.host.length(1) - 1, params, kPageTable),
                           &why)) {
          shared->Fail(absl::StrCat("hog selection differs: ", why));
        }
        ++shared->verified;
      }
    }
    absl::SleepFor(absl::Milliseconds(std::uniform_int_distribution<int>(20, 200)(rng)));
    if (!shared->Running()) {
      kept->merge(mine);  // left for the final checks
      break;
    }
    for (const auto& [id, o] : mine) {
      const absl::StatusOr<v1::ReleaseSequenceResponse> r = c->ReleaseSequence(id);
      shared->tally.Add("hog release", r.status().code());
      if (!r.ok()) shared->Fail(absl::StrCat("hog release: ", r.status().ToString()));
    }
  }
}

// Client processes killed mid-stream: each runs this test binary's SoakClientProcess test
// (below), which prefills its sequences and decodes over a BatchStream until it is killed.
void KillerLoop(Shared* shared, int64_t* killed) {
  std::mt19937 rng(777);
  std::unique_ptr<IndexerClient> c = Connect(shared->port);
  for (int round = 0; shared->Running() && shared->failures.load() < 20; ++round) {
    const std::string prefix = absl::StrCat("killed-", round, "-");
    Child child({"/proc/self/exe", "--gtest_filter=SoakClientProcess.*"},
                {absl::StrCat("INDEXER_SOAK_CLIENT=", shared->port, ":", prefix)});
    absl::SleepFor(absl::Milliseconds(std::uniform_int_distribution<int>(100, 900)(rng)));
    kill(child.pid(), SIGKILL);
    child.Wait(absl::Seconds(10));
    ++*killed;
    // Let the server finish what the dead client had in flight, then clean up after it.
    absl::SleepFor(absl::Milliseconds(300));
    for (int i = 0; i < 3; ++i) {
      const absl::StatusOr<v1::ReleaseSequenceResponse> r = c->ReleaseSequence(absl::StrCat(prefix, i));
      shared->tally.Add("release after a killed client", r.status().code());
      if (!r.ok() && r.status().code() != absl::StatusCode::kNotFound) {
        shared->Fail(absl::StrCat("release after a killed client: ", r.status().ToString()));
      }
    }
    absl::SleepFor(absl::Milliseconds(std::uniform_int_distribution<int>(200, 1200)(rng)));
  }
}

// The server's resident set, from /proc (bytes; -1 when it cannot be read).
int64_t ResidentBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/statm"));
  int64_t size = 0, resident = -1;
  in >> size >> resident;
  return resident < 0 ? -1 : resident * sysconf(_SC_PAGESIZE);
}

struct RssSample {
  double t;  // seconds since the start
  int64_t bytes;
};

// Least-squares slope of bytes over time, in bytes per second.
double Slope(const std::vector<RssSample>& s) {
  double mt = 0, mb = 0;
  for (const RssSample& x : s) {
    mt += x.t;
    mb += static_cast<double>(x.bytes);
  }
  mt /= s.size();
  mb /= s.size();
  double num = 0, den = 0;
  for (const RssSample& x : s) {
    num += (x.t - mt) * (static_cast<double>(x.bytes) - mb);
    den += (x.t - mt) * (x.t - mt);
  }
  return den > 0 ? num / den : 0;
}

double MiB(double bytes) { return bytes / (1 << 20); }

// Sanitizer runtimes manage memory their own way (AddressSanitizer keeps up to 256 MiB of freed
// memory in quarantine, ThreadSanitizer grows shadow memory as addresses are first used), so the
// server's RSS says nothing about leaks there; LeakSanitizer checks those builds instead.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

TEST(Soak, ConcurrentClientsWithFaultsLoseNothing) {
  const double seconds = SoakSeconds();
  int port = 0;
  std::unique_ptr<Child> server = StartServerBinary(
      {"--head_dim=64", "--layers=2", absl::StrCat("--capacity=", kCapacityPages),
       absl::StrCat("--max_sequences=", kMaxSequences),
       absl::StrCat("--max_tokens_per_sequence=", kMaxTokens), "--max_index_heads=4",
       "--max_topk=16", "--topk=8", "--pages_per_block=4", "--block_page_stride=8",
       "--max_batch_items=16", "--cpu_threads=2", "--handler_threads=8", "--drain_seconds=10",
       "--not_serving_seconds=0"},
      &port);
  ASSERT_NE(server, nullptr);
  std::unique_ptr<IndexerClient> admin = Connect(port);
  ASSERT_TRUE(admin->WaitUntilServing(absl::Seconds(20)).ok());

  Shared shared;
  shared.port = port;
  const absl::Time start = absl::Now();
  shared.end = start + absl::Seconds(seconds);
  std::vector<RssSample> rss;
  std::atomic<bool> sampling{true};
  std::thread sampler([&] {
    while (sampling.load()) {
      rss.push_back({absl::ToDoubleSeconds(absl::Now() - start), ResidentBytes(server->pid())});
      absl::SleepFor(absl::Milliseconds(250));
    }
  });

  std::vector<std::unique_ptr<Worker>> workers;
  for (int i = 0; i < kWorkers; ++i) workers.push_back(std::make_unique<Worker>(i, &shared, 1000 + i));
  std::map<std::string, Owned> hog_kept;
  int64_t killed = 0;
  std::vector<std::thread> threads;
  for (auto& w : workers) threads.emplace_back([&w] { w->Run(); });
  threads.emplace_back([&] { HogLoop(&shared, &hog_kept); });
  threads.emplace_back([&] { KillerLoop(&shared, &killed); });
  for (auto& t : threads) t.join();
  const double ran = absl::ToDoubleSeconds(absl::Now() - start);
  sampling = false;
  sampler.join();
  ASSERT_FALSE(server->Wait(absl::ZeroDuration()).has_value())
      << "indexer-server died during the soak:\n" << server->Log();

  // Everything that should survive: the workers' sequences, forks still in the mailbox, the hog's.
  std::map<std::string, Owned> survivors = std::move(hog_kept);
  for (auto& w : workers) survivors.merge(w->sequences());
  for (auto& box : shared.mailbox) {
    for (auto& [id, o] : box) survivors.emplace(id, std::move(o));
  }

  // Exactly the pages the survivors need, shared where forks share them.
  std::map<int32_t, int> holders;
  std::map<std::string, v1::GetSequenceResponse> described;
  for (const auto& [id, o] : survivors) {
    absl::StatusOr<v1::GetSequenceResponse> g = admin->GetSequence(id);
    ASSERT_TRUE(g.ok()) << id << ": " << g.status();
    EXPECT_EQ(std::vector<uint32_t>(g->lengths().begin(), g->lengths().end()), o.Lengths()) << id;
    EXPECT_EQ(std::vector<int32_t>(g->attention_pages().begin(), g->attention_pages().end()),
              o.host.attention_pages)
        << id;
    EXPECT_EQ(g->pages_size(), BlocksFor(o.MaxLength())) << id;
    for (int32_t p : g->pages()) ++holders[p];
    described[id] = *g;
  }
  for (const auto& [id, g] : described) {
    uint32_t shared_pages = 0;
    for (int32_t p : g.pages()) shared_pages += holders[p] > 1 ? 1 : 0;
    EXPECT_EQ(g.shared_pages(), shared_pages) << id;
  }
  absl::StatusOr<v1::ServerInfoResponse> info = admin->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->live_sequences(), survivors.size()) << "sequences nobody owns are left";
  EXPECT_EQ(info->total_pages() - info->free_pages(), holders.size())
      << "the pages in use are not exactly the survivors' pages";

  // Every survivor still selects exactly what the reference says, on every layer.
  std::mt19937 rng(99);
  int64_t final_checks = 0;
  for (const auto& [id, o] : survivors) {
    for (int layer = 0; layer < kLayers; ++layer) {
      const int64_t len = o.host.length(layer);
      if (len == 0) continue;
      const int n = static_cast<int>(std::min<int64_t>(len, 4));
      const std::vector<float> q = IntValues(rng, static_cast<size_t>(n) * 2 * kHeadDim);
      const kernels::SelectParams params{kMaxTopk, 1, 1};
      v1::SelectBlocksRequest req = client::MakeSelect(id, layer, 2, q);
      req.set_topk(params.topk);
      req.set_init_blocks(params.init_blocks);
      req.set_local_blocks(params.local_blocks);
      const absl::StatusOr<Selection> got = admin->Select(req);
      ASSERT_TRUE(got.ok()) << id << ": " << got.status();
      std::string why;
      EXPECT_TRUE(SameSelection(*got, o.host.Select(layer, q, 2, len - n, params, kPageTable), &why))
          << id << " layer " << layer << ": " << why;
      ++final_checks;
    }
  }

  // Releasing them returns every page.
  for (const auto& [id, o] : survivors) EXPECT_TRUE(admin->ReleaseSequence(id).ok()) << id;
  info = admin->ServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->free_pages(), info->total_pages());
  EXPECT_EQ(info->live_sequences(), 0u);

  // Memory: no growth after warm-up (a quarter of the run, at least 10 s: the key pool is
  // touched page by page until the hog has filled it once, and gRPC and malloc warm up).
  const double warmup = std::max(10.0, ran / 4);
  std::vector<RssSample> steady;
  for (const RssSample& s : rss) {
    if (s.t >= warmup && s.bytes > 0) steady.push_back(s);
  }
  ASSERT_GE(steady.size(), 8u) << "too few memory samples after warm-up";
  const size_t fifth = std::max<size_t>(1, steady.size() / 5);
  double first = 0, last = 0;
  int64_t peak = 0;
  for (size_t i = 0; i < fifth; ++i) first += static_cast<double>(steady[i].bytes) / fifth;
  for (size_t i = steady.size() - fifth; i < steady.size(); ++i) {
    last += static_cast<double>(steady[i].bytes) / fifth;
  }
  for (const RssSample& s : steady) peak = std::max(peak, s.bytes);
  const double slope = Slope(steady);
  const double growth = last - first;

  // SIGTERM: a clean exit, and nothing a sanitizer reported.
  ASSERT_EQ(kill(server->pid(), SIGTERM), 0);
  const std::optional<int> code = server->Wait(absl::Seconds(30));
  const std::string log = server->Log();
  EXPECT_EQ(code, std::optional<int>(0)) << log;
  for (const char* report : {"ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
                             "WARNING: ThreadSanitizer", "runtime error:"}) {
    EXPECT_THAT(log, ::testing::Not(::testing::HasSubstr(report))) << log;
  }

  std::printf(
      "soak: %.0f s, %d workers + a pool hog + %lld killed client processes; %lld calls, %lld "
      "selections checked exactly, %lld unknown outcomes settled, %lld RESOURCE_EXHAUSTED\n"
      "soak: afterwards %zu sequences survived holding %zu pages (%lld shared-page checks), "
      "%lld final selections checked, all released: %llu of %llu pages free\n"
      "soak: server RSS after %.0f s warm-up: %.1f MiB first fifth, %.1f MiB last fifth "
      "(growth %+.2f MiB), peak %.1f MiB, slope %+.3f MiB/min over %zu samples\n"
      "soak: calls by outcome:\n%s",
      ran, kWorkers, static_cast<long long>(killed), static_cast<long long>(shared.tally.Total()),
      static_cast<long long>(shared.verified.load()), static_cast<long long>(shared.resynced.load()),
      static_cast<long long>(shared.exhausted.load()), survivors.size(), holders.size(),
      static_cast<long long>(described.size()), static_cast<long long>(final_checks),
      static_cast<unsigned long long>(info->free_pages()),
      static_cast<unsigned long long>(info->total_pages()), warmup, MiB(first), MiB(last),
      MiB(growth), MiB(static_cast<double>(peak)), MiB(slope) * 60, steady.size(),
      shared.tally.Report().c_str());
  EXPECT_GT(shared.verified.load(), 100) << "the soak checked too few selections to mean much";
  EXPECT_GT(shared.exhausted.load(), 0) << "the pool was never exhausted";
  // Flat: the last fifth within 8 MiB (or 10%) of the first fifth after warm-up.
  if (!kSanitized) {
    EXPECT_LT(growth, std::max(8.0 * (1 << 20), 0.10 * first))
        << "the server's memory grew by " << MiB(growth) << " MiB after warm-up";
  }
}

// A client process for KillerLoop: INDEXER_SOAK_CLIENT=<port>:<id prefix>. Prefills three
// sequences, then decodes over one BatchStream until it is killed. Skipped otherwise.
TEST(SoakClientProcess, DecodesUntilKilled) {
  const char* spec = std::getenv("INDEXER_SOAK_CLIENT");
  if (spec == nullptr) GTEST_SKIP() << "runs only as a soak client process";
  const std::vector<std::string> parts = absl::StrSplit(spec, absl::MaxSplits(':', 1));
  ASSERT_EQ(parts.size(), 2u);
  std::unique_ptr<IndexerClient> c = Connect(std::stoi(parts[0]));
  std::mt19937 rng(static_cast<uint32_t>(getpid()));
  for (int i = 0; i < 3; ++i) {
    (void)c->AppendKeys(client::MakeAppendAllLayers(
        absl::StrCat(parts[1], i), IntValues(rng, size_t{200} * kLayers * kHeadDim)));
  }
  std::unique_ptr<BatchStream> stream = c->OpenBatchStream();
  for (uint64_t step = 0;; ++step) {
    v1::BatchRequest req;
    req.set_request_id(step);
    for (int i = 0; i < 3; ++i) {
      v1::SelectBlocksRequest* item = req.add_items();
      *item = client::MakeSelect(absl::StrCat(parts[1], i), 0, 2, IntValues(rng, 2 * kHeadDim));
      *item->mutable_append() = client::MakeAppendAllLayers("", IntValues(rng, kLayers * kHeadDim));
    }
    if (!stream->Write(req)) return;
    if (step % 4 != 3) continue;  // keep several steps in flight
    v1::BatchResponse resp;
    for (int k = 0; k < 4; ++k) {
      if (!stream->Read(&resp)) return;
    }
  }
}

}  // namespace
}  // namespace indexer::testing
