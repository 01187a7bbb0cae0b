/* A stand-in for libnccl.so.2 for the eBPF tests: NCCL's API functions with their true signatures
 * (nccl.h), so that the probe reads the arguments where the real library gets them. A communicator
 * is a small struct; a collective waits for every rank of its communicator (a barrier in shared
 * memory named after the unique id), as a training step's collectives keep ranks in step. Nothing
 * is sent anywhere; sendrecv and group calls return at once.
 */
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef enum { ncclSuccess = 0, ncclInvalidArgument = 4, ncclInvalidUsage = 5 } ncclResult_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef void *cudaStream_t;
typedef struct { size_t size; unsigned magic; int version; int blocking; } ncclConfig_t;

struct barrier { volatile int count, generation; };
struct ncclComm {
    int rank, nranks;
    ncclUniqueId id;
    struct barrier *shared;
};
typedef struct ncclComm *ncclComm_t;

#define EXPORT __attribute__((visibility("default"), noinline))

static struct barrier *barrier_for(const ncclUniqueId *id, const char *suffix) {
    char name[96] = "/dev/shm/gw-fakenccl-";
    size_t n = strlen(name);
    for (int i = 0; i < 8; i++)
        n += snprintf(name + n, sizeof(name) - n, "%02x", (unsigned char)id->internal[i]);
    snprintf(name + n, sizeof(name) - n, "%s", suffix);
    int fd = open(name, O_RDWR | O_CREAT, 0600);
    if (fd < 0 || ftruncate(fd, sizeof(struct barrier)) != 0)
        return NULL;
    void *p = mmap(NULL, sizeof(struct barrier), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    return p == MAP_FAILED ? NULL : p;
}

static void wait_all(ncclComm_t comm) {
    struct barrier *b = comm->shared;
    if (!b || comm->nranks < 2)
        return;
    int gen = __atomic_load_n(&b->generation, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == comm->nranks) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELEASE);
        __atomic_add_fetch(&b->generation, 1, __ATOMIC_ACQ_REL);
        return;
    }
    while (__atomic_load_n(&b->generation, __ATOMIC_ACQUIRE) == gen)
        usleep(50);
}

EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    int fd = open("/dev/urandom", O_RDONLY);
    ssize_t got = fd >= 0 ? read(fd, id->internal, sizeof(id->internal)) : -1;
    if (fd >= 0)
        close(fd);
    return got == (ssize_t)sizeof(id->internal) ? ncclSuccess : ncclInvalidUsage;
}

static ncclResult_t init(ncclComm_t *comm, int nranks, const ncclUniqueId *id, int rank, const char *suffix) {
    if (!comm || nranks < 1 || rank < 0 || rank >= nranks)
        return ncclInvalidArgument;
    struct ncclComm *c = calloc(1, sizeof(*c));
    c->rank = rank;
    c->nranks = nranks;
    c->id = *id;
    c->shared = barrier_for(id, suffix);
    *comm = c;
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
    return init(comm, nranks, &commId, rank, "");
}

EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                          ncclConfig_t *config) {
    (void)config;
    return init(comm, nranks, &commId, rank, "");
}

EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
    (void)key;
    (void)config;
    if (!comm || !newcomm)
        return ncclInvalidArgument;
    // the ranks of one color: here every rank of the parent, with a barrier of their own
    char suffix[32];
    snprintf(suffix, sizeof(suffix), "-split%d", color);
    return init(newcomm, comm->nranks, &comm->id, comm->rank, suffix);
}

EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm)
        return ncclInvalidArgument;
    if (comm->shared)
        munmap(comm->shared, sizeof(struct barrier));
    free(comm);
    return ncclSuccess;
}

EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) {
    return ncclCommDestroy(comm);
}

#define COLLECTIVE(comm) do { if (!(comm)) return ncclInvalidArgument; wait_all(comm); return ncclSuccess; } while (0)

EXPORT ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                  ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    (void)sendbuff, (void)recvbuff, (void)count, (void)datatype, (void)op, (void)stream;
    COLLECTIVE(comm);
}

EXPORT ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                                  ncclComm_t comm, cudaStream_t stream) {
    (void)sendbuff, (void)recvbuff, (void)sendcount, (void)datatype, (void)stream;
    COLLECTIVE(comm);
}

EXPORT ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                      ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    (void)sendbuff, (void)recvbuff, (void)recvcount, (void)datatype, (void)op, (void)stream;
    COLLECTIVE(comm);
}

EXPORT ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                  int root, ncclComm_t comm, cudaStream_t stream) {
    (void)sendbuff, (void)recvbuff, (void)count, (void)datatype, (void)root, (void)stream;
    COLLECTIVE(comm);
}

EXPORT ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                               ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
    (void)sendbuff, (void)recvbuff, (void)count, (void)datatype, (void)op, (void)root, (void)stream;
    COLLECTIVE(comm);
}

EXPORT ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                             ncclComm_t comm, cudaStream_t stream) {
    (void)sendbuff, (void)count, (void)datatype, (void)peer, (void)stream;
    return comm ? ncclSuccess : ncclInvalidArgument;
}

EXPORT ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                             cudaStream_t stream) {
    (void)recvbuff, (void)count, (void)datatype, (void)peer, (void)stream;
    return comm ? ncclSuccess : ncclInvalidArgument;
}

EXPORT ncclResult_t ncclGroupStart(void) { return ncclSuccess; }
EXPORT ncclResult_t ncclGroupEnd(void) { return ncclSuccess; }
