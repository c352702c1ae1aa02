/* moekit's MPI shim (shim.c): its C ABI, which src/lib.rs declares to Rust. */
#ifndef MOEKIT_MPI_SHIM_H
#define MOEKIT_MPI_SHIM_H

#include <stdint.h>

#define MOEKIT_MPI_BYTES 0
#define MOEKIT_MPI_F32 1
#define MOEKIT_MPI_U64 2

/* moekit_mpi_init: MPI was initialised before. */
#define MOEKIT_MPI_ALREADY_INITIALISED (-1)
/* A request or message handle could not be allocated. */
#define MOEKIT_MPI_NO_MEMORY (-2)

struct moekit_mpi_comm;
struct moekit_mpi_request;
struct moekit_mpi_message;

int moekit_mpi_init(void);
int moekit_mpi_finalize(void);
int moekit_mpi_comm_world(struct moekit_mpi_comm **out);
int moekit_mpi_comm_split(const struct moekit_mpi_comm *parent, int color, int key,
                          struct moekit_mpi_comm **out);
int moekit_mpi_comm_free(struct moekit_mpi_comm *comm);
int moekit_mpi_rank(const struct moekit_mpi_comm *comm, int *rank);
int moekit_mpi_size(const struct moekit_mpi_comm *comm, int *size);
void moekit_mpi_abort(int code);
int moekit_mpi_isend(const struct moekit_mpi_comm *comm, const void *buffer, int count, int kind,
                     int dst, int tag, struct moekit_mpi_request **out);
int moekit_mpi_isend_rows(const struct moekit_mpi_comm *comm, const float *source, int rows,
                          const int64_t *row_byte_offsets, int row_words, int dst, int tag,
                          struct moekit_mpi_request **out);
int moekit_mpi_irecv(const struct moekit_mpi_comm *comm, void *buffer, int count, int kind,
                     int src, int tag, struct moekit_mpi_request **out);
int moekit_mpi_test(struct moekit_mpi_request *request, int kind, int *done, int64_t *count);
int moekit_mpi_improbe(const struct moekit_mpi_comm *comm, int src, int tag, int kind, int *found,
                       struct moekit_mpi_message **message, int64_t *count);
int moekit_mpi_imrecv(void *buffer, int count, int kind, struct moekit_mpi_message *message,
                      struct moekit_mpi_request **out);

#endif
