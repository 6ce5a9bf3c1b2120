#include "tests/kernels/naive_reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <string>

namespace indexer::testing {
namespace {

constexpr int64_t kBlock = 128;  // SPEC.md: block_size = 128

struct Candidate {
  float score;
  int32_t id;
};

// SPEC.md step 4: larger score first, ties to the lower block id. -0.0 == +0.0 under float ==.
bool Better(const Candidate& a, const Candidate& b) {
  if (a.score != b.score) return a.score > b.score;
  return a.id < b.id;
}

}  // namespace

float NaiveBf16ToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

float NaiveFp8ToFloat(uint8_t byte) {
  // e4m3: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal.
  const int sign = (byte & 0x80) ? -1 : 1;
  const int e = (byte >> 3) & 0xf;
  const int m = byte & 0x7;
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return static_cast<float>(sign * mag);
}

// Value d of the fp4 key in page `page`, slot `slot` (the layout of kernels/numeric.h: a page's
// codes, two per byte with the even value in the low nibble, then its scales).
float NaiveFp4Value(const uint8_t* pool, int head_dim, int64_t page, int64_t slot, int d) {
  static const double kMagnitudes[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  const int64_t page_bytes = kBlock * (head_dim / 2 + head_dim / 16);
  const uint8_t byte = pool[page * page_bytes + slot * (head_dim / 2) + d / 2];
  const int code = d % 2 == 0 ? byte & 0xf : byte >> 4;
  const int64_t scales = page * page_bytes + kBlock * (head_dim / 2);
  const uint8_t scale = pool[scales + slot * (head_dim / 16) + d / 16];
  const double v = kMagnitudes[code & 7] * NaiveFp8ToFloat(scale);
  return static_cast<float>((code & 8) ? -v : v);
}

void NaivePageTableRow(const std::vector<int32_t>& selected, int64_t pos, const int32_t* attn_pages,
                       int pages_per_block, int block_page_stride, std::vector<int32_t>* row,
                       int32_t* context_len) {
  const int64_t self = pos / kBlock;
  std::vector<int32_t> full;
  bool tail = false;
  for (int32_t b : selected) {
    if (b >= 0 && b < self) full.push_back(b);
    if (b == self) tail = true;
  }
  std::vector<int32_t> order = full;
  if (tail) order.push_back(static_cast<int32_t>(self));
  row->assign(selected.size() * pages_per_block, 0);
  for (size_t slot = 0; slot < order.size(); ++slot) {
    for (int j = 0; j < pages_per_block; ++j) {
      const int64_t v = int64_t{attn_pages[order[slot]]} * block_page_stride + j;
      (*row)[slot * pages_per_block + j] = static_cast<int32_t>(v);
    }
  }
  const int64_t n_full = static_cast<int64_t>(full.size());
  const int64_t n_valid = static_cast<int64_t>(order.size());
  const int64_t len = tail ? n_full * kBlock + (pos + 1 - kBlock * self)
                           : std::min(n_valid * kBlock, pos + 1);
  *context_len = static_cast<int32_t>(len);
}

std::vector<NaiveRow> NaiveSelect(const NaiveSpan& s) {
  const int d_count = s.head_dim;
  const int64_t p_last = s.start_pos + s.num_tokens - 1;

  // Every key the span can see, decoded once: keys[t][d] for t <= p_last.
  std::vector<float> keys(static_cast<size_t>(p_last + 1) * d_count);
  for (int64_t t = 0; t <= p_last; ++t) {
    const int64_t page = s.block_table[t / kBlock];
    const int64_t base = (page * kBlock + t % kBlock) * d_count;
    for (int d = 0; d < d_count; ++d) {
      float v;
      if (s.storage == kernels::KeyStorage::kBf16) {
        uint16_t bits;
        std::memcpy(&bits, static_cast<const uint8_t*>(s.pool) + (base + d) * 2, 2);
        v = NaiveBf16ToFloat(bits);
      } else if (s.storage == kernels::KeyStorage::kFp4E2M1) {
        v = NaiveFp4Value(static_cast<const uint8_t*>(s.pool), d_count, page, t % kBlock, d);
      } else {
        v = NaiveFp8ToFloat(static_cast<const uint8_t*>(s.pool)[base + d]);
      }
      keys[t * d_count + d] = v;
    }
  }

  std::vector<NaiveRow> rows;
  for (int i = 0; i < s.num_tokens; ++i) {
    const int64_t pos = s.start_pos + i;
    const int64_t visible = pos / kBlock + 1;
    for (int h = 0; h < s.num_heads; ++h) {
      NaiveRow row;
      row.pos = pos;
      std::vector<float> q(d_count);
      for (int d = 0; d < d_count; ++d) {
        q[d] = NaiveBf16ToFloat(s.queries[(int64_t{i} * s.num_heads + h) * d_count + d]);
      }
      row.raw.assign(visible, 0.0f);
      row.magnitude.assign(visible, 0.0);
      for (int64_t b = 0; b < visible; ++b) {
        bool any = false;
        float best = 0.0f;
        double magnitude = 0.0;
        for (int64_t t = b * kBlock; t <= std::min(b * kBlock + kBlock - 1, pos); ++t) {
          float dot = 0.0f;
          double abs_sum = 0.0;
          for (int d = 0; d < d_count; ++d) {
            const float product = q[d] * keys[t * d_count + d];
            dot = dot + product;
            abs_sum += std::fabs(static_cast<double>(q[d]) * keys[t * d_count + d]);
          }
          if (std::isnan(dot)) continue;  // left out of the max
          if (!any || dot > best) best = dot;
          any = true;
          magnitude = std::max(magnitude, abs_sum);
        }
        row.raw[b] = any ? best : -1e30f;
        row.magnitude[b] = magnitude;
      }

      row.score = row.raw;
      row.forced.assign(visible, false);
      for (int64_t b = 0; b < visible; ++b) {
        if (b < s.init_blocks) {
          row.score[b] = 1e30f;
          row.forced[b] = true;
        }
        if (b >= visible - s.local_blocks) {
          row.score[b] = 1e29f;
          row.forced[b] = true;
        }
      }

      std::vector<Candidate> all;
      for (int64_t b = 0; b < visible; ++b) all.push_back({row.score[b], static_cast<int32_t>(b)});
      std::sort(all.begin(), all.end(), Better);
      row.selected.assign(s.topk, -1);
      for (int j = 0; j < s.topk && j < static_cast<int>(all.size()); ++j) {
        row.selected[j] = all[j].id;
      }
      if (s.attn_pages != nullptr) {
        NaivePageTableRow(row.selected, pos, s.attn_pages, s.pages_per_block, s.block_page_stride,
                          &row.page_row, &row.context_len);
      }
      rows.push_back(std::move(row));
    }
  }
  return rows;
}

::testing::AssertionResult IsValidTopK(const NaiveRow& ref, const int32_t* got, int topk,
                                       double rel_tol) {
  const int64_t visible = static_cast<int64_t>(ref.score.size());
  const int64_t k = std::min<int64_t>(topk, visible);
  const auto describe = [&] {
    std::string s = " (pos " + std::to_string(ref.pos) + ", V " + std::to_string(visible) +
                    ", got [";
    for (int j = 0; j < topk; ++j) {
      if (j > 0) s += ' ';
      s += std::to_string(got[j]);
    }
    s += "], naive [";
    for (int j = 0; j < topk; ++j) {
      if (j > 0) s += ' ';
      s += std::to_string(ref.selected[j]);
    }
    return s + "])";
  };
  std::set<int32_t> chosen;
  for (int j = 0; j < topk; ++j) {
    if (j >= k) {
      if (got[j] != -1) {
        return ::testing::AssertionFailure() << "entry " << j << " is " << got[j]
                                             << ", expected -1 padding" << describe();
      }
      continue;
    }
    if (got[j] < 0 || got[j] >= visible) {
      return ::testing::AssertionFailure()
             << "entry " << j << " is " << got[j] << ", not a visible block" << describe();
    }
    if (!chosen.insert(got[j]).second) {
      return ::testing::AssertionFailure() << "block " << got[j] << " selected twice" << describe();
    }
  }
  // Whether block a may be ranked before block b.
  const auto may_precede = [&](int32_t a, int32_t b) {
    const float sa = ref.score[a], sb = ref.score[b];
    const double tol = (ref.forced[a] || ref.forced[b])
                           ? 0.0
                           : rel_tol * (ref.magnitude[a] + ref.magnitude[b]);
    if (tol == 0.0) return sa > sb || (sa == sb && a < b);
    return static_cast<double>(sa) >= static_cast<double>(sb) - tol;
  };
  for (int64_t j = 0; j + 1 < k; ++j) {
    if (!may_precede(got[j], got[j + 1])) {
      return ::testing::AssertionFailure()
             << "block " << got[j] << " (score " << ref.score[got[j]] << ") is ranked before block "
             << got[j + 1] << " (score " << ref.score[got[j + 1]] << ")" << describe();
    }
  }
  for (int32_t a : chosen) {
    for (int32_t u = 0; u < visible; ++u) {
      if (chosen.count(u) == 0 && !may_precede(a, u)) {
        return ::testing::AssertionFailure()
               << "block " << a << " (score " << ref.score[a] << ") selected over block " << u
               << " (score " << ref.score[u] << ")" << describe();
      }
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace indexer::testing
