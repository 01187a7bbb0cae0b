/* One "rank" of a job over the fake libnccl.so.2, with known NCCL calls, for the eBPF tests.
 *
 * nccl_driver RANK NRANKS ID_HEX DELAY_MS LOOPS [EXTRA]: ID_HEX is the communicator's ncclUniqueId (256 hex
 * digits: the test gives every rank the same one, as a launcher would). Protocol on stdin/stdout:
 * prints "ready <pid>", waits for a line, then makes the communicator (rank 0 through
 * ncclCommInitRank, the others through ncclCommInitRankConfig: the probe reads the id both ways),
 * splits it (color 0), runs LOOPS times the workload below, sleeping DELAY_MS before each
 * collective (the planted straggler), destroys both, then makes EXTRA more communicators of one
 * rank each (ids differing in bytes 8-11, kept until exit: a process flooding the probe with
 * communicators) with one all-reduce of 4 floats on each, prints "done", waits for a line or EOF
 * and exits 0. The counts are mirrored in test_ebpf_nccl.py (PER_LOOP); keep the two in step.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int ncclResult_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef struct ncclComm *ncclComm_t;
typedef struct { size_t size; unsigned magic; int version; int blocking; } ncclConfig_t;

ncclResult_t ncclCommInitRank(ncclComm_t *, int, ncclUniqueId, int);
ncclResult_t ncclCommInitRankConfig(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
ncclResult_t ncclCommSplit(ncclComm_t, int, int, ncclComm_t *, ncclConfig_t *);
ncclResult_t ncclCommDestroy(ncclComm_t);
ncclResult_t ncclAllReduce(const void *, void *, size_t, int, int, ncclComm_t, void *);
ncclResult_t ncclAllGather(const void *, void *, size_t, int, ncclComm_t, void *);
ncclResult_t ncclReduceScatter(const void *, void *, size_t, int, int, ncclComm_t, void *);
ncclResult_t ncclBroadcast(const void *, void *, size_t, int, int, ncclComm_t, void *);
ncclResult_t ncclReduce(const void *, void *, size_t, int, int, int, ncclComm_t, void *);
ncclResult_t ncclSend(const void *, size_t, int, int, ncclComm_t, void *);
ncclResult_t ncclRecv(void *, size_t, int, int, ncclComm_t, void *);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

enum { INT8 = 0, UINT8 = 1, INT32 = 2, INT64 = 4, FLOAT16 = 6, FLOAT32 = 7, FLOAT64 = 8, BFLOAT16 = 9 };

static int delay_ms;
static char buf[1 << 16];
static void *stream = (void *)0x5;

static void late(void) {
    if (delay_ms > 0)
        usleep(delay_ms * 1000);
}

static void check(ncclResult_t r, const char *what) {
    if (r != 0) {
        fprintf(stderr, "%s returned %d\n", what, r);
        exit(1);
    }
}

static void sendrecv(ncclComm_t comm, int sends, int recvs, int peer) {
    check(ncclGroupStart(), "ncclGroupStart");
    for (int i = 0; i < sends; i++)
        check(ncclSend(buf, 10, INT32, peer, comm, stream), "ncclSend");
    for (int i = 0; i < recvs; i++)
        check(ncclRecv(buf, 10, INT32, peer, comm, stream), "ncclRecv");
    check(ncclGroupEnd(), "ncclGroupEnd");
}

static void workload(ncclComm_t comm, ncclComm_t sub, int peer) {
    for (int i = 0; i < 17; i++) {
        late();
        check(ncclAllReduce(buf, buf, 1024, FLOAT32, 0, comm, stream), "ncclAllReduce");
    }
    for (int i = 0; i < 5; i++) {
        late();
        check(ncclAllGather(buf, buf, 256, BFLOAT16, comm, stream), "ncclAllGather");
    }
    for (int i = 0; i < 7; i++) {
        late();
        check(ncclReduceScatter(buf, buf, 100, INT64, 0, comm, stream), "ncclReduceScatter");
    }
    for (int i = 0; i < 3; i++) {
        late();
        check(ncclBroadcast(buf, buf, 333, UINT8, 0, comm, stream), "ncclBroadcast");
    }
    for (int i = 0; i < 2; i++) {
        late();
        check(ncclReduce(buf, buf, 50, FLOAT64, 0, 0, comm, stream), "ncclReduce");
    }
    sendrecv(comm, 4, 4, peer);
    sendrecv(comm, 4, 4, peer);
    sendrecv(comm, 3, 5, peer);
    for (int i = 0; i < 2; i++) {
        late();
        check(ncclAllReduce(buf, buf, 64, FLOAT16, 0, sub, stream), "ncclAllReduce (split)");
    }
}

int main(int argc, char **argv) {
    if ((argc != 6 && argc != 7) || strlen(argv[3]) != 256) {
        fprintf(stderr, "usage: nccl_driver RANK NRANKS ID_HEX(256) DELAY_MS LOOPS [EXTRA]\n");
        return 2;
    }
    int rank = atoi(argv[1]), nranks = atoi(argv[2]), loops = atoi(argv[5]);
    delay_ms = atoi(argv[4]);
    ncclUniqueId id;
    for (int i = 0; i < 128; i++) {
        unsigned v;
        sscanf(argv[3] + 2 * i, "%2x", &v);
        id.internal[i] = (char)v;
    }
    printf("ready %d\n", getpid());
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof(line), stdin))
        return 0;
    ncclComm_t comm, sub;
    ncclConfig_t config = {sizeof(ncclConfig_t), 0xcafebeef, 0, 1};
    if (rank == 0)
        check(ncclCommInitRank(&comm, nranks, id, rank), "ncclCommInitRank");
    else
        check(ncclCommInitRankConfig(&comm, nranks, id, rank, &config), "ncclCommInitRankConfig");
    check(ncclCommSplit(comm, 0, rank, &sub, NULL), "ncclCommSplit");
    for (int l = 0; l < loops; l++)
        workload(comm, sub, (rank + 1) % nranks);
    check(ncclCommDestroy(sub), "ncclCommDestroy");
    check(ncclCommDestroy(comm), "ncclCommDestroy");
    int extra = argc == 7 ? atoi(argv[6]) : 0;
    for (int i = 0; i < extra; i++) {
        ncclComm_t c;
        memcpy(id.internal + 8, &i, sizeof(i));
        check(ncclCommInitRank(&c, 1, id, 0), "ncclCommInitRank (extra)");
        check(ncclAllReduce(buf, buf, 4, FLOAT32, 0, c, stream), "ncclAllReduce (extra)");
    }
    printf("done\n");
    fflush(stdout);
    fgets(line, sizeof(line), stdin);
    return 0;
}
