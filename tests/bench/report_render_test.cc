// The HTML report as a person sees it: headless Chromium (Debian's `chromium`, installed by
// scripts/setup.sh) renders a synthetic sweep's report to a PNG, which is decoded here (zlib) and
// must show the charts: many colours, much non-white, and the pixels of the charts' own colours.
// Skips with a message when Chromium is not installed.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/bench/report.h"
#include "tests/bench/sample_report.h"
#include "tests/testing/files.h"

namespace indexer::bench {
namespace {

std::string FindChromium() {
  if (const char* env = std::getenv("INDEXER_CHROMIUM"); env != nullptr && *env) return env;
  for (const char* path :
       {"/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"}) {
    if (access(path, X_OK) == 0) return path;
  }
  return "";
}

struct Image {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> rgb;  // [height][width][3]
};

uint32_t BigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

int Paeth(int a, int b, int c) {
  const int p = a + b - c;
  const int pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
  if (pa <= pb && pa <= pc) return a;
  return pb <= pc ? b : c;
}

// Decodes an 8-bit RGB or RGBA, non-interlaced PNG (what Chromium writes). Empty on failure,
// with the reason in *error.
Image DecodePng(const std::string& data, std::string* error) {
  Image img;
  static const uint8_t kSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (data.size() < 8 ||
      data.compare(0, 8, std::string(reinterpret_cast<const char*>(kSignature), 8)) != 0) {
    *error = "not a PNG";
    return {};
  }
  int channels = 0;
  std::string idat;
  for (size_t at = 8; at + 12 <= data.size();) {
    const auto* p = reinterpret_cast<const uint8_t*>(data.data() + at);
    const uint32_t len = BigEndian32(p);
    const std::string type(data.data() + at + 4, 4);
    if (at + 12 + len > data.size()) break;
    const auto* body = p + 8;
    if (type == "IHDR") {
      img.width = static_cast<int>(BigEndian32(body));
      img.height = static_cast<int>(BigEndian32(body + 4));
      const int depth = body[8], color = body[9], interlace = body[12];
      if (depth != 8 || (color != 2 && color != 6) || interlace != 0) {
        *error = absl::StrCat("unsupported PNG: depth ", depth, " colour type ", color,
                              " interlace ", interlace);
        return {};
      }
      channels = color == 2 ? 3 : 4;
    } else if (type == "IDAT") {
      idat.append(reinterpret_cast<const char*>(body), len);
    } else if (type == "IEND") {
      break;
    }
    at += 12 + len;
  }
  if (channels == 0 || img.width <= 0 || img.height <= 0) {
    *error = "no IHDR";
    return {};
  }
  const size_t stride = static_cast<size_t>(img.width) * channels;
  std::vector<uint8_t> raw((stride + 1) * img.height);
  uLongf raw_size = raw.size();
  if (uncompress(raw.data(), &raw_size, reinterpret_cast<const Bytef*>(idat.data()), idat.size()) !=
          Z_OK ||
      raw_size != raw.size()) {
    *error = "zlib could not inflate the image data";
    return {};
  }
  std::vector<uint8_t> prev(stride, 0), cur(stride);
  img.rgb.resize(static_cast<size_t>(img.width) * img.height * 3);
  for (int y = 0; y < img.height; ++y) {
    const uint8_t filter = raw[y * (stride + 1)];
    const uint8_t* in = &raw[y * (stride + 1) + 1];
    for (size_t x = 0; x < stride; ++x) {
      const int a = x >= static_cast<size_t>(channels) ? cur[x - channels] : 0;
      const int b = prev[x];
      const int c = x >= static_cast<size_t>(channels) ? prev[x - channels] : 0;
      int v = in[x];
      switch (filter) {
        case 0:
          break;
        case 1:
          v += a;
          break;
        case 2:
          v += b;
          break;
        case 3:
          v += (a + b) / 2;
          break;
        case 4:
          v += Paeth(a, b, c);
          break;
        default:
          *error = absl::StrCat("bad filter ", filter);
          return {};
      }
      cur[x] = static_cast<uint8_t>(v);
    }
    for (int x = 0; x < img.width; ++x) {
      for (int k = 0; k < 3; ++k)
        img.rgb[(static_cast<size_t>(y) * img.width + x) * 3 + k] = cur[x * channels + k];
    }
    std::swap(prev, cur);
  }
  return img;
}

using testing::ReadFile;

TEST(ReportRenderTest, ChromiumShowsTheCharts) {
  const std::string chromium = FindChromium();
  if (chromium.empty()) {
    GTEST_SKIP() << "chromium is not installed (apt-get install chromium; scripts/setup.sh does): "
                    "cannot render the HTML report";
  }
  char dir_template[] = "/tmp/indexer-bench-render-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  const std::string html = dir + "/report.html";
  const std::string png = dir + "/report.png";
  ASSERT_TRUE(WriteTextFile(html, HtmlReport(SampleReport(3))).ok());
  const std::string command =
      absl::StrCat("timeout 90 '", chromium,
                   "' --headless --no-sandbox --disable-gpu --disable-quic --no-first-run "
                   "--disable-background-networking --disable-component-update --disable-sync "
                   "--user-data-dir='",
                   dir, "/profile' --screenshot='", png, "' --window-size=1200,1400 'file://", html,
                   "' > '", dir, "/chromium.log' 2>&1");
  const int status = std::system(command.c_str());
  const std::string png_data = ReadFile(png);
  ASSERT_FALSE(png_data.empty()) << "chromium (exit " << status << ") wrote no screenshot:\n"
                                 << ReadFile(dir + "/chromium.log");
  std::string error;
  const Image img = DecodePng(png_data, &error);
  ASSERT_FALSE(img.rgb.empty()) << error;
  EXPECT_EQ(img.width, 1200);
  EXPECT_EQ(img.height, 1400);

  std::set<uint32_t> colours;
  int64_t non_white = 0;
  const auto has = [&](uint8_t r, uint8_t g, uint8_t b) {
    return colours.count((uint32_t{r} << 16) | (uint32_t{g} << 8) | b) > 0;
  };
  for (size_t i = 0; i < img.rgb.size(); i += 3) {
    const uint8_t r = img.rgb[i], g = img.rgb[i + 1], b = img.rgb[i + 2];
    colours.insert((uint32_t{r} << 16) | (uint32_t{g} << 8) | b);
    if (r < 240 || g < 240 || b < 240) ++non_white;
  }
  const double non_white_fraction =
      static_cast<double>(non_white) / (img.width * static_cast<double>(img.height));
  EXPECT_GT(colours.size(), 200u) << "a blank or flat page";
  EXPECT_GT(non_white_fraction, 0.03);
  EXPECT_TRUE(has(0x4c, 0x78, 0xa8)) << "no histogram bar pixels";
  EXPECT_TRUE(has(0xd6, 0x27, 0x28)) << "no p99 line pixels";
  EXPECT_TRUE(has(0x1f, 0x77, 0xb4)) << "no p50 / throughput line pixels";
  std::printf("rendered %dx%d: %zu colours, %.1f%% non-white\n", img.width, img.height,
              colours.size(), 100 * non_white_fraction);
  // Keep the page, screenshot and Chromium's profile only when something failed.
  if (!HasFailure()) {
    std::filesystem::remove_all(dir);
  } else {
    std::printf("kept %s for inspection\n", dir.c_str());
  }
}

}  // namespace
}  // namespace indexer::bench
