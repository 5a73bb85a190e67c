// The C++ client's tests: CHECK and friends (no test framework: CHECK prints what
// failed and where; the exit code counts failures), and enough of a JSON reader for
// tests/vectors/protocol_vectors.json.
#pragma once

#include <shmserve/client.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>

namespace test {

inline int failures = 0;

#define CHECK(cond, ...)                                                                 \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      test::failures++;                                                                  \
      std::fprintf(stderr, "FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond);             \
      std::fprintf(stderr, "%s\n", test::describe(__VA_ARGS__).c_str());                 \
    }                                                                                    \
  } while (0)

template <class... A> std::string describe(const A &...a) {
  std::ostringstream s;
  (s << ... << a);
  return s.str();
}

/// Runs fn, expects an exception of type E with this status whose message contains `needle`.
template <class E>
void expect_error(const std::string &what, const std::function<void()> &fn, const std::string &needle,
                  shmserve::Status status) {
  try {
    fn();
    CHECK(false, what, ": no error raised");
  } catch (const E &e) {
    CHECK(e.status() == status, what, ": status ", shmserve::status_name(e.status()));
    CHECK(std::string(e.what()).find(needle) != std::string::npos, what, ": message '", e.what(),
          "' lacks '", needle, "'");
  } catch (const std::exception &e) {
    CHECK(false, what, ": wrong exception type: ", e.what());
  }
}

inline void run(const char *name, const std::function<void()> &fn) {
  int before = failures;
  auto t0 = std::chrono::steady_clock::now();
  try {
    fn();
  } catch (const std::exception &e) {
    failures++;
    std::fprintf(stderr, "FAILED %s: unexpected exception: %s\n", name, e.what());
  }
  double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%s %s (%.0f ms)\n", failures == before ? "ok  " : "FAIL", name, ms);
  std::fflush(stdout);
}

inline std::string hex(const void *p, size_t n) {
  static const char *d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; i++) {
    unsigned char c = static_cast<const unsigned char *>(p)[i];
    s += d[c >> 4];
    s += d[c & 15];
  }
  return s;
}
inline std::string hex(const std::string &s) { return hex(s.data(), s.size()); }
inline std::string unhex(const std::string &h) {
  std::string s;
  for (size_t i = 0; i + 1 < h.size(); i += 2) s += static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16));
  return s;
}

inline std::string read_file(const std::string &path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

/// A JSON value: objects keep their order.
struct Json {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  std::string text;  // a string's value, a number's or a literal's spelling
  std::vector<Json> items;
  std::vector<std::pair<std::string, Json>> members;
  const Json *get(std::string_view key) const {
    for (const auto &[k, v] : members) if (k == key) return &v;
    return nullptr;
  }
  const std::string &str(std::string_view key) const {
    static const std::string none;
    const Json *v = get(key);
    return v ? v->text : none;
  }
};

class JsonReader {
 public:
  explicit JsonReader(std::string_view s) : s_(s) {}
  Json read() {
    Json v = value();
    skip();
    if (i_ != s_.size()) fail("text after the value");
    return v;
  }

 private:
  [[noreturn]] void fail(const char *why) { throw std::runtime_error("JSON at byte " + std::to_string(i_) + ": " + why); }
  void skip() { while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) i_++; }
  char peek() {
    skip();
    if (i_ >= s_.size()) fail("unexpected end");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) fail("unexpected character");
    i_++;
  }
  Json value() {
    Json v;
    char c = peek();
    if (c == '{' || c == '[') {
      v.kind = c == '{' ? Json::Object : Json::Array;
      i_++;
      const char close = c == '{' ? '}' : ']';
      while (peek() != close) {
        if (v.kind == Json::Object) {
          std::string key = string();
          expect(':');
          v.members.emplace_back(std::move(key), value());
        } else {
          v.items.push_back(value());
        }
        if (peek() == ',') i_++;
      }
      i_++;
    } else if (c == '"') {
      v.kind = Json::String;
      v.text = string();
    } else {
      size_t start = i_;
      while (i_ < s_.size() && std::string_view(",]} \n\r\t").find(s_[i_]) == std::string_view::npos) i_++;
      v.text = std::string(s_.substr(start, i_ - start));
      v.kind = v.text == "null" ? Json::Null : v.text == "true" || v.text == "false" ? Json::Bool : Json::Number;
    }
    return v;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unterminated escape");
      c = s_[i_++];
      if (c == 'u') {
        unsigned cp = static_cast<unsigned>(std::stoul(std::string(s_.substr(i_, 4)), nullptr, 16));
        i_ += 4;
        if (cp < 0x80) out += static_cast<char>(cp);
        else if (cp < 0x800) out += static_cast<char>(0xc0 | cp >> 6), out += static_cast<char>(0x80 | (cp & 0x3f));
        else
          out += static_cast<char>(0xe0 | cp >> 12), out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f)),
              out += static_cast<char>(0x80 | (cp & 0x3f));
      } else {
        const char *from = "bfnrt", *to = "\b\f\n\r\t";
        const char *at = std::strchr(from, c);
        out += at && c ? to[at - from] : c;
      }
    }
    expect('"');
    return out;
  }
  std::string_view s_;
  size_t i_ = 0;
};

}  // namespace test
