// The NCCL tuner plugin, loaded the way NCCL loads it (dlopen + the v5 symbol), on a made-up
// cost table: the rules' cells become the cheapest, nothing else moves.
extern "C" {
#include "../../csrc/nccl_tuner/tuner_abi.h"
}

#include <gtest/gtest.h>

#include <dlfcn.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace {

std::vector<std::string> logged;

void logger(ncclDebugLogLevel, unsigned long, const char*, int, const char* fmt, ...) {
  char buf[512];
  va_list args;
  va_start(args, fmt);
  vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  logged.emplace_back(buf);
}

class Tuner : public ::testing::Test {
 protected:
  void SetUp() override {
    handle_ = dlopen(COMMTUNE_TUNER_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(handle_, nullptr) << dlerror();
    plugin_ = static_cast<const ncclTuner_v5_t*>(dlsym(handle_, "ncclTunerPlugin_v5"));
    ASSERT_NE(plugin_, nullptr);
    logged.clear();
  }
  void TearDown() override {
    if (ctx_) plugin_->finalize(ctx_);
    if (handle_) dlclose(handle_);
    unsetenv("COMMTUNE_TUNER_RULES");
  }
  void start(const std::string& rules) {
    const std::string path = ::testing::TempDir() + "commtune_rules.txt";
    std::ofstream(path) << rules;
    setenv("COMMTUNE_TUNER_RULES", path.c_str(), 1);
    ASSERT_EQ(plugin_->init(&ctx_, 7, 8, 1, logger, nullptr, nullptr), ncclSuccess);
  }
  // Costs 10 + 3a + p everywhere, NVLS rows not allowed (as with multicast off).
  static std::vector<float> table() {
    std::vector<float> t(NUM_ALGORITHMS * NUM_PROTOCOLS);
    for (int a = 0; a < NUM_ALGORITHMS; ++a)
      for (int p = 0; p < NUM_PROTOCOLS; ++p)
        t[a * NUM_PROTOCOLS + p] = (a == ALGO_NVLS || a == ALGO_NVLS_TREE) ? ALGO_PROTO_IGNORE : 10.0f + 3 * a + p;
    return t;
  }
  std::vector<float> consult(ncclFunc_t coll, size_t bytes, std::vector<float> t = table()) {
    float* data = t.data();
    int channels = 0;
    EXPECT_EQ(plugin_->getCollInfo(ctx_, coll, bytes, 1, reinterpret_cast<float**>(data), NUM_ALGORITHMS,
                                   NUM_PROTOCOLS, 0, &channels), ncclSuccess);
    return t;
  }
  static std::vector<float> with_zero(int a, int p) {
    std::vector<float> t = table();
    t[a * NUM_PROTOCOLS + p] = 0.0f;
    return t;
  }

  void* handle_ = nullptr;
  const ncclTuner_v5_t* plugin_ = nullptr;
  void* ctx_ = nullptr;
};

TEST_F(Tuner, RulesPickTheirCellsBySizeAndCollective) {
  start("# from commtune tune nccl\n"
        "allreduce 0 1048576 ring simple\n"
        "allreduce 1048577 18446744073709551615 tree *   # cheapest protocol of Tree\n"
        "allgather 0 100 * ll128\n");
  EXPECT_EQ(consult(ncclFuncAllReduce, 4096), with_zero(ALGO_RING, PROTO_SIMPLE));
  EXPECT_EQ(consult(ncclFuncAllReduce, 1048576), with_zero(ALGO_RING, PROTO_SIMPLE));
  EXPECT_EQ(consult(ncclFuncAllReduce, 1048577), with_zero(ALGO_TREE, PROTO_LL));
  std::vector<float> no_tree_ll = table();
  no_tree_ll[ALGO_TREE * NUM_PROTOCOLS + PROTO_LL] = ALGO_PROTO_IGNORE;
  std::vector<float> expected = no_tree_ll;
  expected[ALGO_TREE * NUM_PROTOCOLS + PROTO_LL128] = 0.0f;  // the cheapest cell NCCL still allows
  EXPECT_EQ(consult(ncclFuncAllReduce, 8 << 20, no_tree_ll), expected);
  EXPECT_EQ(consult(ncclFuncAllGather, 64), with_zero(ALGO_TREE, PROTO_LL128));
  EXPECT_EQ(consult(ncclFuncAllGather, 4096), table());  // no rule: NCCL's own choice
  EXPECT_EQ(consult(ncclFuncBroadcast, 64), table());
  bool announced = false;
  for (const std::string& line : logged) announced |= line.find("chose ring/simple for 4096 B") != std::string::npos;
  EXPECT_TRUE(announced);
}

TEST_F(Tuner, RulesNcclCannotHonourLeaveItsChoice) {
  start("allreduce 0 100 nvls *\nnonsense line\nallreduce 0 100 ring ll\n");
  EXPECT_EQ(consult(ncclFuncAllReduce, 64), table());  // first match wins, and NVLS is not allowed
  bool warned = false;
  for (const std::string& line : logged) warned |= line.find(":2 is not") != std::string::npos;
  EXPECT_TRUE(warned);
}

TEST_F(Tuner, WithoutRulesNcclTunesAlone) {
  unsetenv("COMMTUNE_TUNER_RULES");
  ASSERT_EQ(plugin_->init(&ctx_, 7, 8, 1, logger, nullptr, nullptr), ncclSuccess);
  EXPECT_EQ(consult(ncclFuncAllReduce, 4096), table());
  ASSERT_FALSE(logged.empty());
  EXPECT_NE(logged[0].find("COMMTUNE_TUNER_RULES is not set"), std::string::npos);
}

}  // namespace
