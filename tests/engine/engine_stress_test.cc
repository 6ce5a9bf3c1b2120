// Long random runs of the engine against a model, and many threads at once.
//
// RandomOperations: thousands of append / select / fork / truncate / release / batch operations
// over a handful of sequences and a pool small enough to run out. The model predicts every
// status (including RESOURCE_EXHAUSTED, counting copy-on-write pages) and every selection; after
// every operation the page accounting is checked: free pages + distinct pages in use == total,
// each sequence's shared_pages equals its pages referenced by more than one block table, and at
// the end, with every sequence released, every page is free.
//
// Concurrency: threads append / select / batch / fork / truncate / release their own sequences,
// read and fork a shared immutable one, and append to shared sequences whose keys are all
// equal (so their content does not depend on thread timing). Results are checked against models
// as they arrive; accounting is exact at the end.
//
// Seeds come from std::random_device and are printed with every failure; INDEXER_TEST_SEED
// replays one.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "tests/engine/engine_test_util.h"
#include "tests/testing/test_seed.h"

namespace indexer::testing {
namespace {

using engine::SequenceInfo;

using ::indexer::testing::TestSeed;

int64_t Uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

// Checks the accounting of every live sequence against `models` (ids -> model) and returns the
// number of references per page.
std::map<int32_t, int> CheckAccounting(const Engine& e, const std::map<std::string, SeqModel>& models,
                                       std::map<std::string, SequenceInfo>* infos = nullptr) {
  std::map<int32_t, int> refs;
  std::map<std::string, SequenceInfo> got;
  const int64_t total = e.Stats().total_pages;
  for (const auto& [id, m] : models) {
    absl::StatusOr<SequenceInfo> info = e.Get(id);
    EXPECT_TRUE(info.ok()) << id << ": " << info.status();
    if (!info.ok()) continue;
    EXPECT_EQ(info->lengths, m.Lengths()) << id;
    EXPECT_EQ(static_cast<int64_t>(info->pages.size()), m.Blocks()) << id;
    EXPECT_EQ(info->attention_pages, m.has_attn ? m.attn : std::vector<int32_t>{}) << id;
    for (int32_t p : info->pages) {
      EXPECT_GE(p, 0) << id;
      EXPECT_LT(p, total) << id;
      ++refs[p];
    }
    got[id] = *info;
  }
  for (const auto& [id, info] : got) {
    std::set<int32_t> own(info.pages.begin(), info.pages.end());
    EXPECT_EQ(own.size(), info.pages.size()) << id << " holds a page twice";
    int64_t shared = 0;
    for (int32_t p : info.pages) shared += refs[p] > 1;
    EXPECT_EQ(info.shared_pages, shared) << id << ": shared_pages vs references in block tables";
  }
  const engine::EngineStats stats = e.Stats();
  EXPECT_EQ(stats.live_sequences, static_cast<int64_t>(models.size()));
  EXPECT_EQ(stats.free_pages + static_cast<int64_t>(refs.size()), stats.total_pages)
      << "free pages + distinct pages in use != total";
  if (infos) *infos = std::move(got);
  return refs;
}

// Pages an append to `m` (lengths per layer after: `after`) needs: new blocks plus copies of
// existing blocks it writes that another block table also references.
int64_t PagesNeeded(const SeqModel& m, const SequenceInfo& info, const std::map<int32_t, int>& refs,
                    int layer_begin, int layer_count, int64_t n) {
  const int64_t old_blocks = static_cast<int64_t>(info.pages.size());
  int64_t max_len = 0;
  std::set<int64_t> cow;
  for (int l = 0; l < static_cast<int>(m.keys.size()); ++l) {
    const bool grows = l >= layer_begin && l < layer_begin + layer_count;
    const int64_t before = m.Len(l), after = before + (grows ? n : 0);
    max_len = std::max(max_len, after);
    if (!grows) continue;
    for (int64_t b = before / 128; b < std::min(BlocksFor(after), old_blocks); ++b) {
      if (refs.at(info.pages[b]) > 1) cow.insert(b);
    }
  }
  return BlocksFor(max_len) - old_blocks + static_cast<int64_t>(cow.size());
}

class RandomRun {
 public:
  explicit RandomRun(uint64_t seed) : rng_(seed) {
    config_ = SmallEngineConfig();
    config_.layers = 2;
    config_.capacity_pages = 24;
    config_.max_topk = 16;
    config_.defaults = kernels::SelectParams{6, 1, 1};
    engine_ = MakeEngine(config_);
  }

  void Run(int ops) {
    for (int op = 0; op < ops && !::testing::Test::HasFailure(); ++op) {
      refs_ = CheckAccounting(*engine_, models_, &infos_);
      const int64_t kind = Uniform(rng_, 0, 99);
      SCOPED_TRACE(::testing::Message() << "op " << op << " kind " << kind);
      if (kind < 35) {
        Append();
      } else if (kind < 55) {
        Select();
      } else if (kind < 67) {
        Fork();
      } else if (kind < 77) {
        Truncate();
      } else if (kind < 87) {
        Release();
      } else {
        Batch();
      }
      ++counts_[kind < 35 ? "append" : kind < 55 ? "select" : kind < 67 ? "fork"
                 : kind < 77 ? "truncate" : kind < 87 ? "release" : "batch"];
    }
    refs_ = CheckAccounting(*engine_, models_, &infos_);
    for (const auto& [id, m] : models_) EXPECT_TRUE(engine_->Release(id).ok()) << id;
    models_.clear();
    const engine::EngineStats stats = engine_->Stats();
    EXPECT_EQ(stats.free_pages, stats.total_pages);
    EXPECT_EQ(stats.live_sequences, 0);
  }

  std::string Summary() const {
    std::string s;
    for (const auto& [k, v] : counts_) absl::StrAppend(&s, k, " ", v, ", ");
    absl::StrAppend(&s, "exhausted ", exhausted_, ", selections checked ", selections_);
    return s;
  }

 private:
  std::string AnyId() { return "s" + std::to_string(Uniform(rng_, 0, 9)); }
  std::optional<std::string> LiveId() {
    if (models_.empty()) return std::nullopt;
    auto it = models_.begin();
    std::advance(it, Uniform(rng_, 0, static_cast<int64_t>(models_.size()) - 1));
    return it->first;
  }
  int64_t RandomTokens() {
    switch (Uniform(rng_, 0, 3)) {
      case 0: return Uniform(rng_, 1, 3);
      case 1: return Uniform(rng_, 1, 64);
      default: return Uniform(rng_, 1, 300);
    }
  }

  // A planned append: the request pieces, what it needs and what the model becomes.
  struct Plan {
    std::string id;
    int layer_begin = 0, layer_count = 1;
    bool all_layers = false;
    int64_t n = 0;
    std::vector<uint16_t> keys;
    std::vector<int32_t> attn;
    int64_t pages = 0;
    bool creates = false;
  };

  Plan PlanAppend(const std::string& id) {
    Plan p;
    p.id = id;
    p.n = RandomTokens();
    p.all_layers = Uniform(rng_, 0, 4) == 0;
    p.layer_begin = p.all_layers ? 0 : static_cast<int>(Uniform(rng_, 0, config_.layers - 1));
    p.layer_count = p.all_layers ? config_.layers : 1;
    p.keys = RandomBf16(rng_, static_cast<size_t>(p.n) * p.layer_count * config_.head_dim);
    auto it = models_.find(id);
    p.creates = it == models_.end();
    const SeqModel m = p.creates ? SeqModel(config_.layers, config_.head_dim) : it->second;
    const SequenceInfo info = p.creates ? SequenceInfo{} : infos_.at(id);
    p.pages = PagesNeeded(m, info, refs_, p.layer_begin, p.layer_count, p.n);
    int64_t max_len = 0;
    for (int l = 0; l < config_.layers; ++l) {
      const bool grows = l >= p.layer_begin && l < p.layer_begin + p.layer_count;
      max_len = std::max(max_len, m.Len(l) + (grows ? p.n : 0));
    }
    const int64_t opened = BlocksFor(max_len) - m.Blocks();
    const bool attn = m.attn_decided ? m.has_attn : Uniform(rng_, 0, 2) == 0;
    if (attn) {
      for (int64_t b = 0; b < opened; ++b) p.attn.push_back(static_cast<int32_t>(Uniform(rng_, 0, 999)));
    }
    return p;
  }

  void ApplyPlan(SeqModel& m, const Plan& p) const {
    for (int64_t t = 0; t < p.n; ++t) {
      for (int l = 0; l < p.layer_count; ++l) {
        const auto row = p.keys.begin() + (t * p.layer_count + l) * config_.head_dim;
        m.keys[p.layer_begin + l].insert(m.keys[p.layer_begin + l].end(), row,
                                         row + config_.head_dim);
      }
    }
    // The first append decides whether the sequence has attention pages.
    if (!m.attn_decided) {
      m.attn_decided = true;
      m.has_attn = !p.attn.empty();
    }
    m.attn.insert(m.attn.end(), p.attn.begin(), p.attn.end());
  }

  void ApplyToModel(const Plan& p) {
    ApplyPlan(models_.try_emplace(p.id, config_.layers, config_.head_dim).first->second, p);
  }

  void Append() {
    const Plan p = PlanAppend(AnyId());
    const std::string bytes = Bytes(p.keys);
    const AppendRequest r = Bf16Append(p.id, p.layer_begin, bytes, p.all_layers, p.attn);
    const int64_t free = engine_->Stats().free_pages;
    absl::StatusOr<StepResult> got = engine_->Append(r);
    if (p.pages > free) {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted)
          << got.status() << " (needs " << p.pages << " pages, " << free << " free)";
      ++exhausted_;
      return;
    }
    ASSERT_TRUE(got.ok()) << got.status() << " (needs " << p.pages << " pages, " << free
                          << " free)";
    EXPECT_EQ(got->created, p.creates);
    ApplyToModel(p);
    EXPECT_EQ(got->lengths, models_.at(p.id).Lengths());
  }

  SelectArgs RandomSelect(const SeqModel& m, int* n) {
    SelectArgs a;
    std::vector<int> layers;
    for (int l = 0; l < config_.layers; ++l) {
      if (m.Len(l) > 0) layers.push_back(l);
    }
    a.layer = layers[Uniform(rng_, 0, static_cast<int64_t>(layers.size()) - 1)];
    const int64_t len = m.Len(static_cast<int>(a.layer));
    *n = static_cast<int>(Uniform(rng_, 1, std::min<int64_t>(len, Uniform(rng_, 0, 3) ? 4 : 200)));
    a.heads = static_cast<int>(Uniform(rng_, 1, 2));
    if (Uniform(rng_, 0, 1)) a.start = Uniform(rng_, 0, len - *n);
    if (Uniform(rng_, 0, 1)) a.topk = Uniform(rng_, 1, 16);
    if (Uniform(rng_, 0, 2) == 0) a.init_blocks = Uniform(rng_, 0, 2);
    if (Uniform(rng_, 0, 2) == 0) a.local_blocks = Uniform(rng_, 0, 2);
    return a;
  }

  void SelectOne(const std::string& id) {
    const SeqModel& m = models_.at(id);
    if (m.MaxLen() == 0) {
      EXPECT_EQ(SelectQueries(*engine_, id, RandomBf16(rng_, config_.head_dim), {}).status().code(),
                absl::StatusCode::kFailedPrecondition);
      return;
    }
    int n = 1;
    const SelectArgs a = RandomSelect(m, &n);
    SCOPED_TRACE(::testing::Message() << "select " << id << " layer " << a.layer << " n " << n);
    const absl::Status s = CheckSelection(*engine_, config_, id, m, rng_, a, n);
    EXPECT_TRUE(s.ok()) << s;
    ++selections_;
  }

  void Select() {
    if (auto id = LiveId()) SelectOne(*id);
  }

  void Fork() {
    const auto src = LiveId();
    if (!src) return;
    const std::string target = AnyId();
    std::optional<int64_t> length;
    if (Uniform(rng_, 0, 1)) length = Uniform(rng_, 0, models_.at(*src).MaxLen() + 10);
    absl::StatusOr<engine::ForkResult> got = engine_->Fork(*src, target, length);
    if (target == *src) {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
      return;
    }
    if (models_.count(target)) {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kAlreadyExists) << got.status();
      return;
    }
    ASSERT_TRUE(got.ok()) << got.status();
    SeqModel m = models_.at(*src);
    if (length) m.Truncate(*length);
    EXPECT_EQ(got->lengths, m.Lengths());
    EXPECT_EQ(got->num_blocks, m.Blocks());
    models_[target] = std::move(m);
    SelectOne(target);
  }

  void Truncate() {
    const auto id = LiveId();
    if (!id) return;
    SeqModel& m = models_.at(*id);
    const int64_t len = Uniform(rng_, 0, m.MaxLen());
    const int64_t old_blocks = m.Blocks();
    absl::StatusOr<engine::TruncateResult> got = engine_->Truncate(*id, len);
    ASSERT_TRUE(got.ok()) << got.status();
    // Pages freed: dropped blocks that no other block table references.
    int64_t freed = 0;
    m.Truncate(len);
    const SequenceInfo& info = infos_.at(*id);
    for (int64_t b = m.Blocks(); b < old_blocks; ++b) freed += refs_.at(info.pages[b]) == 1;
    EXPECT_EQ(got->pages_freed, freed);
    EXPECT_EQ(got->lengths, m.Lengths());
    SelectOne(*id);
  }

  void Release() {
    const auto id = LiveId();
    if (!id) return;
    int64_t freed = 0;
    for (int32_t p : infos_.at(*id).pages) freed += refs_.at(p) == 1;
    absl::StatusOr<int64_t> got = engine_->Release(*id);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, freed);
    models_.erase(*id);
    EXPECT_EQ(engine_->Release(*id).status().code(), absl::StatusCode::kNotFound);
  }

  // Items on distinct sequences (appends that certainly fit, selects, or both), then a
  // select-only item on the first item's sequence: a second wave that must see the first's
  // append. Appends that might not fit are left out, since items of one wave are applied in an
  // unspecified order and which of them would get the last pages is not defined.
  void Batch() {
    struct Item {
      std::string id;
      std::optional<Plan> plan;
      SeqModel after;
      bool select = false;
      SelectArgs args;
      int n = 0;
      std::vector<uint16_t> queries;
      std::string key_bytes, query_bytes;
    };
    std::set<std::string> ids;
    const int64_t want = Uniform(rng_, 1, 4);
    for (int i = 0; i < 10 && static_cast<int64_t>(ids.size()) < want; ++i) ids.insert(AnyId());
    int64_t budget = engine_->Stats().free_pages;
    std::vector<Item> items;
    for (const std::string& id : ids) {
      Item it;
      it.id = id;
      const bool live = models_.count(id) > 0;
      it.after = live ? models_.at(id) : SeqModel(config_.layers, config_.head_dim);
      if (!live || Uniform(rng_, 0, 1)) {
        Plan p = PlanAppend(id);
        if (p.pages <= budget) {
          budget -= p.pages;
          ApplyPlan(it.after, p);
          it.plan = std::move(p);
        }
      }
      if (it.after.MaxLen() > 0 && (!it.plan || Uniform(rng_, 0, 3) > 0)) {
        it.args = RandomSelect(it.after, &it.n);
        it.select = true;
        it.queries =
            RandomBf16(rng_, static_cast<size_t>(it.n) * it.args.heads * config_.head_dim);
      }
      if (it.plan || it.select) items.push_back(std::move(it));
    }
    if (items.empty()) return;
    std::vector<StepRequest> steps;
    for (Item& it : items) {
      StepRequest s;
      s.sequence_id = it.id;
      if (it.plan) {
        it.key_bytes = Bytes(it.plan->keys);
        s.append = AppendRequest{"", it.plan->layer_begin, it.plan->all_layers, WireDtype::kBf16,
                                 it.key_bytes, it.plan->attn};
      }
      if (it.select) {
        it.query_bytes = Bytes(it.queries);
        s.layer = it.args.layer;
        s.start_position = it.args.start;
        s.num_heads = it.args.heads;
        s.query_dtype = WireDtype::kBf16;
        s.queries = it.query_bytes;
        s.topk = it.args.topk;
        s.init_blocks = it.args.init_blocks;
        s.local_blocks = it.args.local_blocks;
      }
      steps.push_back(s);
    }
    std::vector<uint16_t> tail_q;
    std::string tail_bytes;
    if (items[0].after.Len(0) > 0) {
      tail_q = RandomBf16(rng_, config_.head_dim);
      tail_bytes = Bytes(tail_q);
      StepRequest s;
      s.sequence_id = items[0].id;
      s.num_heads = 1;
      s.query_dtype = WireDtype::kBf16;
      s.queries = tail_bytes;
      steps.push_back(s);
    }
    std::vector<absl::StatusOr<StepResult>> got = engine_->Batch(steps);
    ASSERT_EQ(got.size(), steps.size());
    for (size_t i = 0; i < items.size(); ++i) {
      const Item& it = items[i];
      SCOPED_TRACE(::testing::Message() << "batch item " << i << " on " << it.id);
      ASSERT_TRUE(got[i].ok()) << got[i].status();
      if (it.plan) {
        EXPECT_EQ(got[i]->created, it.plan->creates);
        ApplyToModel(*it.plan);
      }
      EXPECT_EQ(got[i]->lengths, it.after.Lengths());
      if (it.select) {
        const int layer = static_cast<int>(it.args.layer);
        const int64_t start = it.args.start.value_or(it.after.Len(layer) - it.n);
        EXPECT_EQ(got[i]->start_position, start);
        ExpectSameSelection(*got[i], ExpectedSelect(config_, it.after, layer, start, it.n,
                                                    it.args.heads, it.queries,
                                                    EffectiveParams(config_, it.args)));
        ++selections_;
      }
    }
    if (!tail_q.empty()) {
      const absl::StatusOr<StepResult>& t = got.back();
      ASSERT_TRUE(t.ok()) << t.status();
      const int64_t start = items[0].after.Len(0) - 1;
      EXPECT_EQ(t->start_position, start);
      ExpectSameSelection(*t, ExpectedSelect(config_, items[0].after, 0, start, 1, 1, tail_q,
                                             config_.defaults));
      ++selections_;
    }
  }

  EngineConfig config_;
  std::unique_ptr<Engine> engine_;
  std::mt19937_64 rng_;
  std::map<std::string, SeqModel> models_;
  std::map<std::string, SequenceInfo> infos_;
  std::map<int32_t, int> refs_;
  std::map<std::string, int> counts_;
  int exhausted_ = 0;
  int selections_ = 0;
};

TEST(EngineStress, RandomOperationsKeepExactAccounting) {
  const uint64_t seed = TestSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (replay: INDEXER_TEST_SEED=" << seed
                                    << ")");
  RandomRun run(seed);
  run.Run(10000);
  std::cout << "seed " << seed << ": " << run.Summary() << "\n";
}

// ---------------------------------------------------------------------------------------------
// Concurrency

// All keys of the shared "hot" and "race" sequences are this one vector, so their content at
// any length is known whatever order threads appended in.
std::vector<uint16_t> SameKeys(const std::vector<uint16_t>& key, int64_t n) {
  std::vector<uint16_t> v;
  for (int64_t i = 0; i < n; ++i) v.insert(v.end(), key.begin(), key.end());
  return v;
}

TEST(EngineStress, ConcurrentClientsStayCorrectAndAccountingIsExact) {
  const uint64_t seed = TestSeed();
  SCOPED_TRACE(::testing::Message() << "seed " << seed << " (replay: INDEXER_TEST_SEED=" << seed
                                    << ")");
  EngineConfig config = SmallEngineConfig();
  config.capacity_pages = 4096;
  config.cpu_threads = 2;
  config.defaults = kernels::SelectParams{8, 1, 1};
  std::unique_ptr<Engine> engine = MakeEngine(config);
  const int d = config.head_dim;
  std::mt19937_64 setup(seed);

  // "base": read and forked by everyone, never written.
  SeqModel base(1, d);
  base.keys[0] = RandomBf16(setup, static_cast<size_t>(1000) * d);  // block 7 is partial
  ASSERT_TRUE(AppendKeys(*engine, "base", 0, base.keys[0]).ok());
  const std::vector<uint16_t> same = RandomBf16(setup, d);
  const auto same_model = [&](int64_t len) {
    SeqModel m(1, d);
    m.keys[0] = SameKeys(same, len);
    return m;
  };
  ASSERT_TRUE(AppendKeys(*engine, "hot", 0, SameKeys(same, 1)).ok());
  std::atomic<int64_t> hot_appended{1};

  const int kThreads = 6;
  const int kIterations = 1500;
  std::vector<std::map<std::string, SeqModel>> owned(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + 1 + t);
      std::map<std::string, SeqModel>& mine = owned[t];
      int next_id = 0;
      const auto own_id = [&] {
        if (mine.empty() || Uniform(rng, 0, 5) == 0) return absl::StrCat("t", t, "-", next_id++);
        auto it = mine.begin();
        std::advance(it, Uniform(rng, 0, static_cast<int64_t>(mine.size()) - 1));
        return it->first;
      };
      const auto check_same = [&](const StepResult& r, const std::vector<uint16_t>& q, int n,
                                  int heads) {
        ExpectSameSelection(r, ExpectedSelect(config, same_model(r.lengths[0]), 0, r.start_position,
                                              n, heads, q, config.defaults));
      };
      for (int i = 0; i < kIterations && !::testing::Test::HasFailure(); ++i) {
        const int64_t kind = Uniform(rng, 0, 9);
        if (kind <= 1) {  // append to an own sequence
          const std::string id = own_id();
          const std::vector<uint16_t> k = RandomBf16(rng, static_cast<size_t>(Uniform(rng, 1, 200)) * d);
          absl::StatusOr<StepResult> r = AppendKeys(*engine, id, 0, k);
          ASSERT_TRUE(r.ok()) << r.status();
          EXPECT_EQ(r->created, mine.count(id) == 0);
          SeqModel& m = mine.try_emplace(id, 1, d).first->second;
          m.Append(0, k);
          EXPECT_EQ(r->lengths, m.Lengths());
        } else if (kind == 2) {  // select on an own sequence or on base
          std::string id = mine.empty() || Uniform(rng, 0, 1) ? "base" : own_id();
          if (id != "base" && !mine.count(id)) id = "base";
          const SeqModel& m = id == "base" ? base : mine.at(id);
          if (m.MaxLen() == 0) continue;
          SelectArgs a;
          a.heads = static_cast<int>(Uniform(rng, 1, 3));
          const int n = static_cast<int>(Uniform(rng, 1, std::min<int64_t>(8, m.MaxLen())));
          const absl::Status s = CheckSelection(*engine, config, id, m, rng, a, n);
          EXPECT_TRUE(s.ok()) << id << ": " << s;
        } else if (kind == 3) {  // fork base (copy-on-write on its partial page) and write it
          const std::string id = absl::StrCat("t", t, "-", next_id++);
          const int64_t len = Uniform(rng, 1, 1000);
          ASSERT_TRUE(engine->Fork("base", id, len).ok());
          SeqModel m = base;
          m.Truncate(len);
          const std::vector<uint16_t> k = RandomBf16(rng, static_cast<size_t>(Uniform(rng, 1, 40)) * d);
          ASSERT_TRUE(AppendKeys(*engine, id, 0, k).ok());
          m.Append(0, k);
          mine[id] = std::move(m);
          const absl::Status s = CheckSelection(*engine, config, id, mine.at(id), rng, {}, 2);
          EXPECT_TRUE(s.ok()) << s;
        } else if (kind == 4) {  // append to hot and select in one step
          const int64_t n = Uniform(rng, 1, 5);
          const std::string kb = Bytes(SameKeys(same, n));
          const std::vector<uint16_t> q = RandomBf16(rng, static_cast<size_t>(2) * d);
          const std::string qb = Bytes(q);
          StepRequest s = Bf16Select("hot", 0, 2, qb);
          s.append = AppendRequest{"", 0, false, WireDtype::kBf16, kb, {}};
          absl::StatusOr<StepResult> r = engine->Select(s);
          ASSERT_TRUE(r.ok()) << r.status();
          hot_appended += n;
          EXPECT_EQ(r->start_position, r->lengths[0] - 1);
          check_same(*r, q, 1, 2);
        } else if (kind == 5) {  // a batch: own append+select, base select, hot append
          const std::string id = own_id();
          SeqModel m = mine.count(id) ? mine.at(id) : SeqModel(1, d);
          const std::vector<uint16_t> k = RandomBf16(rng, static_cast<size_t>(Uniform(rng, 1, 130)) * d);
          m.Append(0, k);
          const std::vector<uint16_t> q0 = RandomBf16(rng, d), q1 = RandomBf16(rng, d),
                                      q2 = RandomBf16(rng, d);
          const std::string kb = Bytes(k), hb = Bytes(SameKeys(same, 3)), q0b = Bytes(q0),
                            q1b = Bytes(q1), q2b = Bytes(q2);
          std::vector<StepRequest> items(3);
          for (auto& s : items) {
            s.num_heads = 1;
            s.query_dtype = WireDtype::kBf16;
          }
          items[0].sequence_id = id;
          items[0].append = AppendRequest{"", 0, false, WireDtype::kBf16, kb, {}};
          items[0].queries = q0b;
          items[1].sequence_id = "base";
          items[1].queries = q1b;
          items[1].start_position = Uniform(rng, 0, 999);
          items[2].sequence_id = "hot";
          items[2].append = AppendRequest{"", 0, false, WireDtype::kBf16, hb, {}};
          items[2].queries = q2b;
          std::vector<absl::StatusOr<StepResult>> r = engine->Batch(items);
          for (const auto& x : r) ASSERT_TRUE(x.ok()) << x.status();
          hot_appended += 3;
          mine[id] = m;
          ExpectSameSelection(*r[0], ExpectedSelect(config, m, 0, m.Len(0) - 1, 1, 1, q0,
                                                    config.defaults));
          ExpectSameSelection(*r[1], ExpectedSelect(config, base, 0, *items[1].start_position, 1, 1,
                                                    q1, config.defaults));
          check_same(*r[2], q2, 1, 1);
        } else if (kind == 6) {  // fork hot or an own sequence into a new own sequence
          const std::string id = absl::StrCat("t", t, "-", next_id++);
          if (mine.empty() || Uniform(rng, 0, 1)) {
            absl::StatusOr<engine::ForkResult> f = engine->Fork("hot", id, std::nullopt);
            ASSERT_TRUE(f.ok()) << f.status();
            mine[id] = same_model(f->lengths[0]);
          } else {
            const std::string src = own_id();
            if (!mine.count(src)) continue;
            const int64_t len = Uniform(rng, 0, mine.at(src).MaxLen());
            ASSERT_TRUE(engine->Fork(src, id, len).ok());
            SeqModel m = mine.at(src);
            m.Truncate(len);
            mine[id] = std::move(m);
          }
          const std::vector<uint16_t> k = RandomBf16(rng, static_cast<size_t>(Uniform(rng, 1, 50)) * d);
          ASSERT_TRUE(AppendKeys(*engine, id, 0, k).ok());
          mine.at(id).Append(0, k);
          const absl::Status s = CheckSelection(*engine, config, id, mine.at(id), rng, {}, 1);
          EXPECT_TRUE(s.ok()) << s;
        } else if (kind == 7) {  // truncate an own sequence
          if (mine.empty()) continue;
          const std::string id = own_id();
          if (!mine.count(id)) continue;
          const int64_t len = Uniform(rng, 0, mine.at(id).MaxLen());
          absl::StatusOr<engine::TruncateResult> r = engine->Truncate(id, len);
          ASSERT_TRUE(r.ok()) << r.status();
          mine.at(id).Truncate(len);
          EXPECT_EQ(r->lengths, mine.at(id).Lengths());
        } else if (kind == 8) {  // release an own sequence
          if (mine.empty()) continue;
          const std::string id = own_id();
          if (!mine.count(id)) continue;
          ASSERT_TRUE(engine->Release(id).ok());
          mine.erase(id);
        } else {  // contended ids: everyone appends / selects / releases "race0" and "race1"
          const std::string id = absl::StrCat("race", Uniform(rng, 0, 1));
          switch (Uniform(rng, 0, 2)) {
            case 0: {
              absl::StatusOr<StepResult> r = AppendKeys(*engine, id, 0, SameKeys(same, Uniform(rng, 1, 150)));
              ASSERT_TRUE(r.ok()) << r.status();
              break;
            }
            case 1: {
              const std::vector<uint16_t> q = RandomBf16(rng, d);
              absl::StatusOr<StepResult> r = SelectQueries(*engine, id, q, {});
              if (r.ok()) {
                check_same(*r, q, 1, 1);
              } else {
                EXPECT_TRUE(r.status().code() == absl::StatusCode::kNotFound ||
                            r.status().code() == absl::StatusCode::kFailedPrecondition)
                    << r.status();
              }
              break;
            }
            default: {
              const absl::Status s = engine->Release(id).status();
              EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kNotFound) << s;
            }
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();

  // Everything live now: base, hot, the race ids that exist, and every thread's sequences.
  std::map<std::string, SeqModel> all;
  all["base"] = base;
  absl::StatusOr<SequenceInfo> hot = engine->Get("hot");
  ASSERT_TRUE(hot.ok());
  EXPECT_EQ(hot->lengths[0], hot_appended.load());
  all["hot"] = same_model(hot->lengths[0]);
  for (const char* id : {"race0", "race1"}) {
    absl::StatusOr<SequenceInfo> info = engine->Get(id);
    if (info.ok()) all[id] = same_model(info->lengths[0]);
  }
  for (const auto& mine : owned) all.insert(mine.begin(), mine.end());
  CheckAccounting(*engine, all);
  std::mt19937_64 rng(seed);
  for (const auto& [id, m] : all) {
    if (m.MaxLen() == 0) continue;
    const absl::Status s = CheckSelection(*engine, config, id, m, rng, {}, 1);
    EXPECT_TRUE(s.ok()) << id << ": " << s;
  }
  for (const auto& [id, m] : all) EXPECT_TRUE(engine->Release(id).ok()) << id;
  EXPECT_EQ(engine->Stats().free_pages, config.capacity_pages);
  EXPECT_EQ(engine->Stats().live_sequences, 0);
}

}  // namespace
}  // namespace indexer::testing
