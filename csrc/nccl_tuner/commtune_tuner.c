/* libcommtune_nccl_tuner.so: a NCCL tuner plugin (interface v5, NCCL 2.28) that applies the
 * per-size choices of `python -m commtune tune nccl`.
 *
 *   NCCL_TUNER_PLUGIN=/path/libcommtune_nccl_tuner.so COMMTUNE_TUNER_RULES=/path/profile.rules
 *
 * A rules file has one rule per line: `collective min_bytes max_bytes algorithm protocol`, each
 * name lower case or `*`; `#` starts a comment. For a collective of nBytes, the first matching
 * rule wins: of the table cells NCCL allows that match its algorithm and protocol, the cheapest
 * gets cost 0, so NCCL picks it. Where nothing matches, NCCL's own choice stands. */
#include "tuner_abi.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RULES 256
#define ANY (-1)

typedef struct {
  int collective, algorithm, protocol;  /* ANY or an index */
  unsigned long long min_bytes, max_bytes;
  int announced;  /* logged its first use */
} Rule;

typedef struct {
  Rule rules[MAX_RULES];
  int count;
  ncclDebugLogger_t log;
} Context;

static const char* kCollectives[] = {"broadcast", "reduce", "allgather", "reducescatter", "allreduce"};
static const char* kAlgorithms[] = {"tree", "ring", "collnetdirect", "collnetchain", "nvls", "nvlstree", "pat"};
static const char* kProtocols[] = {"ll", "ll128", "simple"};

#define LOG(ctx, level, ...) \
  do { if ((ctx)->log) (ctx)->log(level, NCCL_TUNING_SUBSYS, __FILE__, __LINE__, __VA_ARGS__); } while (0)

/* Index of `word` in names, ANY for "*", -2 when unknown. */
static int lookup(const char* word, const char** names, int n) {
  if (strcmp(word, "*") == 0) return ANY;
  for (int i = 0; i < n; ++i) {
    if (strcmp(word, names[i]) == 0) return i;
  }
  return -2;
}

static int load_rules(Context* ctx, const char* path) {
  FILE* f = fopen(path, "r");
  if (!f) {
    LOG(ctx, NCCL_LOG_WARN, "commtune tuner: cannot read COMMTUNE_TUNER_RULES=%s; NCCL tunes alone", path);
    return 0;
  }
  char line[512];
  int number = 0;
  while (fgets(line, sizeof line, f)) {
    ++number;
    char* hash = strchr(line, '#');
    if (hash) *hash = '\0';
    char coll[32], algo[32], proto[32];
    unsigned long long lo, hi;
    int fields = sscanf(line, "%31s %llu %llu %31s %31s", coll, &lo, &hi, algo, proto);
    if (fields <= 0) continue;  /* blank or comment */
    Rule r = {lookup(coll, kCollectives, 5), lookup(algo, kAlgorithms, NUM_ALGORITHMS),
              lookup(proto, kProtocols, NUM_PROTOCOLS), lo, hi, 0};
    if (fields != 5 || r.collective == -2 || r.algorithm == -2 || r.protocol == -2 || lo > hi) {
      LOG(ctx, NCCL_LOG_WARN, "commtune tuner: %s:%d is not `collective min max algorithm protocol`; skipped",
          path, number);
      continue;
    }
    if (ctx->count == MAX_RULES) {
      LOG(ctx, NCCL_LOG_WARN, "commtune tuner: more than %d rules in %s; the rest ignored", MAX_RULES, path);
      break;
    }
    ctx->rules[ctx->count++] = r;
  }
  fclose(f);
  return ctx->count;
}

static ncclResult_t tuner_init(void** context, uint64_t commId, size_t nRanks, size_t nNodes,
                               ncclDebugLogger_t logFunction, ncclNvlDomainInfo_v5_t* nvl,
                               ncclTunerConstants_v5_t* constants) {
  (void)commId; (void)nvl; (void)constants;
  Context* ctx = (Context*)calloc(1, sizeof(Context));
  if (!ctx) return ncclInternalError;
  ctx->log = logFunction;
  const char* path = getenv("COMMTUNE_TUNER_RULES");
  if (path && *path) {
    load_rules(ctx, path);
  } else {
    LOG(ctx, NCCL_LOG_WARN, "commtune tuner: COMMTUNE_TUNER_RULES is not set; NCCL tunes alone");
  }
  LOG(ctx, NCCL_LOG_INFO, "commtune tuner: %d rule(s) for %zu ranks on %zu node(s)", ctx->count, nRanks, nNodes);
  *context = ctx;
  return ncclSuccess;
}

static ncclResult_t tuner_get_coll_info(void* context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                                        float** collCostTable, int numAlgo, int numProto, int regBuff,
                                        int* nChannels) {
  (void)numPipeOps; (void)regBuff; (void)nChannels;
  Context* ctx = (Context*)context;
  if (!ctx || !collCostTable) return ncclInvalidArgument;
  float* table = (float*)collCostTable;  /* [numAlgo][numProto], contiguous */
  for (int i = 0; i < ctx->count; ++i) {
    Rule* r = &ctx->rules[i];
    if ((r->collective != ANY && r->collective != (int)collType) || nBytes < r->min_bytes || nBytes > r->max_bytes) {
      continue;
    }
    int best_a = -1, best_p = -1;
    for (int a = 0; a < numAlgo; ++a) {
      for (int p = 0; p < numProto; ++p) {
        float cost = table[a * numProto + p];
        if (cost == ALGO_PROTO_IGNORE || (r->algorithm != ANY && r->algorithm != a) ||
            (r->protocol != ANY && r->protocol != p)) {
          continue;
        }
        if (best_a < 0 || cost < table[best_a * numProto + best_p]) {
          best_a = a;
          best_p = p;
        }
      }
    }
    if (best_a >= 0) {
      table[best_a * numProto + best_p] = 0.0f;
      if (!r->announced) {
        r->announced = 1;
        LOG(ctx, NCCL_LOG_INFO, "commtune tuner: rule %d (%llu-%llu B) chose %s/%s for %zu B", i, r->min_bytes,
            r->max_bytes, kAlgorithms[best_a], kProtocols[best_p], nBytes);
      }
    }
    return ncclSuccess;  /* the first matching rule decides, even when NCCL allows none of its cells */
  }
  return ncclSuccess;
}

static ncclResult_t tuner_finalize(void* context) {
  free(context);
  return ncclSuccess;
}

__attribute__((visibility("default"))) const ncclTuner_v5_t ncclTunerPlugin_v5 = {
    "commtune", tuner_init, tuner_get_coll_info, tuner_finalize};
