/* The parts of NCCL's tuner-plugin interface (version 5, NCCL 2.28) this plugin uses, declared
 * here so it builds without NCCL's sources. Layouts and indices follow NCCL's
 * src/include/plugin/tuner/tuner_v5.h; keep them in step when moving to a newer version. */
#ifndef COMMTUNE_TUNER_ABI_H_
#define COMMTUNE_TUNER_ABI_H_

#include <stddef.h>
#include <stdint.h>

typedef enum { ncclSuccess = 0, ncclInternalError = 3, ncclInvalidArgument = 4 } ncclResult_t;
typedef enum { ncclFuncBroadcast = 0, ncclFuncReduce = 1, ncclFuncAllGather = 2, ncclFuncReduceScatter = 3,
               ncclFuncAllReduce = 4 } ncclFunc_t;
typedef enum { NCCL_LOG_NONE = 0, NCCL_LOG_VERSION = 1, NCCL_LOG_WARN = 2, NCCL_LOG_INFO = 3 } ncclDebugLogLevel;
#define NCCL_TUNING_SUBSYS 64
typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char* file, int line,
                                  const char* fmt, ...);

/* Cost-table indices: algorithm rows, protocol columns. */
#define ALGO_TREE 0
#define ALGO_RING 1
#define ALGO_COLLNET_DIRECT 2
#define ALGO_COLLNET_CHAIN 3
#define ALGO_NVLS 4
#define ALGO_NVLS_TREE 5
#define ALGO_PAT 6
#define NUM_ALGORITHMS 7
#define PROTO_LL 0
#define PROTO_LL128 1
#define PROTO_SIMPLE 2
#define NUM_PROTOCOLS 3
#define ALGO_PROTO_IGNORE (-1.0f)

typedef struct {
  int nNvlDomains;
  int minRanksPerNvlDomain;
  int maxRanksPerNvlDomain;
} ncclNvlDomainInfo_v5_t;

typedef struct {
  double baseLatencies[7][3];
  double hwLatencies[3][7][3];
  double llMaxBws[4][3];
  double perChMaxRingLL128Bws[4][3];
  double perChMaxTreeLL128Bws[4][3];
  double perChMaxTreeBws[4][3];
  double perChMaxNVLSTreeBws[4][3];
} ncclTunerConstants_v5_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(void** ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction,
                       ncclNvlDomainInfo_v5_t* nvlDomainInfo, ncclTunerConstants_v5_t* constants);
  ncclResult_t (*getCollInfo)(void* ctx, ncclFunc_t collType, size_t nBytes, int numPipeOps, float** collCostTable,
                              int numAlgo, int numProto, int regBuff, int* nChannels);
  ncclResult_t (*finalize)(void* ctx);
} ncclTuner_v5_t;

#endif
