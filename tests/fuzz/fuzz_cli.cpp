// The command line: the input is split at NUL bytes into arguments after
// "chorus", parsed and checked as the program does (CLI11, the strict
// number validators, TrainConfig::validate), and never run. Any outcome but
// an exit code (a crash, an exception escaping) is a bug: bad command-line
// input never crashes.
#include <cstdint>
#include <string>
#include <vector>

int chorus_main(int argc, char** argv, bool parse_only);

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args{"chorus"};
  std::string cur;
  for (size_t i = 0; i < size && args.size() < 64; ++i) {
    if (data[i] == 0) {
      args.push_back(cur);
      cur.clear();
    } else {
      cur += static_cast<char>(data[i]);
    }
  }
  if (!cur.empty()) args.push_back(cur);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  chorus_main(static_cast<int>(args.size()), argv.data(), /*parse_only=*/true);
  return 0;
}
