/*
 * moekit's MPI shim: the few MPI operations moekit's MpiComm uses, behind a C ABI of plain
 * integers and opaque pointers, so that Rust declares them by hand (src/lib.rs) instead of
 * generating bindings to <mpi.h>, whose handle types differ between MPI implementations.
 * Compiled with mpicc by build.rs.
 *
 * Element kinds: 0 bytes (MPI_BYTE), 1 f32 (MPI_FLOAT), 2 u64 (MPI_UINT64_T).
 * Communicators are heap handles too: the world's (moekit_mpi_comm_world) and those split from
 * one (moekit_mpi_comm_split), each freed by moekit_mpi_comm_free before MPI_Finalize.
 * Every function returns MPI_SUCCESS (0), an MPI error code, or one of the codes below.
 * Requests and messages are heap handles: a request is freed when moekit_mpi_test reports it
 * complete, a message when moekit_mpi_imrecv turns it into a request.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdlib.h>

#include "shim.h"

static MPI_Datatype datatype(int kind) {
    switch (kind) {
    case MOEKIT_MPI_F32:
        return MPI_FLOAT;
    case MOEKIT_MPI_U64:
        return MPI_UINT64_T;
    default:
        return MPI_BYTE;
    }
}

struct moekit_mpi_comm {
    MPI_Comm comm;
};

struct moekit_mpi_request {
    MPI_Request request;
};

struct moekit_mpi_message {
    MPI_Message message;
};

int moekit_mpi_init(void) {
    int initialized = 0;
    int code = MPI_Initialized(&initialized);
    if (code != MPI_SUCCESS) {
        return code;
    }
    if (initialized) {
        return MOEKIT_MPI_ALREADY_INITIALISED;
    }
    return MPI_Init(NULL, NULL);
}

int moekit_mpi_finalize(void) { return MPI_Finalize(); }

int moekit_mpi_comm_world(struct moekit_mpi_comm **out) {
    *out = malloc(sizeof **out);
    if (*out == NULL) {
        return MOEKIT_MPI_NO_MEMORY;
    }
    (*out)->comm = MPI_COMM_WORLD;
    return MPI_SUCCESS;
}

int moekit_mpi_comm_split(const struct moekit_mpi_comm *parent, int color, int key,
                          struct moekit_mpi_comm **out) {
    *out = malloc(sizeof **out);
    if (*out == NULL) {
        return MOEKIT_MPI_NO_MEMORY;
    }
    int code = MPI_Comm_split(parent->comm, color, key, &(*out)->comm);
    if (code != MPI_SUCCESS) {
        free(*out);
        *out = NULL;
    }
    return code;
}

int moekit_mpi_comm_free(struct moekit_mpi_comm *comm) {
    int code = MPI_SUCCESS;
    if (comm->comm != MPI_COMM_WORLD) {
        code = MPI_Comm_free(&comm->comm);
    }
    free(comm);
    return code;
}

int moekit_mpi_rank(const struct moekit_mpi_comm *comm, int *rank) {
    return MPI_Comm_rank(comm->comm, rank);
}

int moekit_mpi_size(const struct moekit_mpi_comm *comm, int *size) {
    return MPI_Comm_size(comm->comm, size);
}

void moekit_mpi_abort(int code) {
    MPI_Abort(MPI_COMM_WORLD, code);
    /* MPI_Abort does not return; should an implementation's do, the process still ends. */
    abort();
}

static int new_request(struct moekit_mpi_request **out) {
    *out = malloc(sizeof **out);
    return *out == NULL ? MOEKIT_MPI_NO_MEMORY : MPI_SUCCESS;
}

int moekit_mpi_isend(const struct moekit_mpi_comm *comm, const void *buffer, int count, int kind,
                     int dst, int tag, struct moekit_mpi_request **out) {
    int code = new_request(out);
    if (code != MPI_SUCCESS) {
        return code;
    }
    return MPI_Isend(buffer, count, datatype(kind), dst, tag, comm->comm, &(*out)->request);
}

int moekit_mpi_isend_rows(const struct moekit_mpi_comm *comm, const float *source, int rows,
                          const int64_t *row_byte_offsets, int row_words, int dst, int tag,
                          struct moekit_mpi_request **out) {
    MPI_Aint *displacements = malloc(sizeof *displacements * (size_t)(rows > 0 ? rows : 1));
    if (displacements == NULL) {
        return MOEKIT_MPI_NO_MEMORY;
    }
    for (int row = 0; row < rows; row++) {
        displacements[row] = (MPI_Aint)row_byte_offsets[row];
    }
    MPI_Datatype rows_type;
    int code = MPI_Type_create_hindexed_block(rows, row_words, displacements, MPI_FLOAT,
                                              &rows_type);
    free(displacements);
    if (code != MPI_SUCCESS) {
        return code;
    }
    code = MPI_Type_commit(&rows_type);
    if (code == MPI_SUCCESS) {
        code = new_request(out);
    }
    if (code == MPI_SUCCESS) {
        code = MPI_Isend(source, 1, rows_type, dst, tag, comm->comm, &(*out)->request);
    }
    /* A datatype freed while a send uses it stays alive until the send completes. */
    MPI_Type_free(&rows_type);
    return code;
}

int moekit_mpi_irecv(const struct moekit_mpi_comm *comm, void *buffer, int count, int kind,
                     int src, int tag, struct moekit_mpi_request **out) {
    int code = new_request(out);
    if (code != MPI_SUCCESS) {
        return code;
    }
    return MPI_Irecv(buffer, count, datatype(kind), src, tag, comm->comm, &(*out)->request);
}

int moekit_mpi_test(struct moekit_mpi_request *request, int kind, int *done, int64_t *count) {
    /* Zeroed: a completed send's status need not be set, and its count is not used. */
    MPI_Status status = {0};
    int code = MPI_Test(&request->request, done, &status);
    if (code != MPI_SUCCESS || !*done) {
        return code;
    }
    int elements = 0;
    code = MPI_Get_count(&status, datatype(kind), &elements);
    *count = elements == MPI_UNDEFINED ? -1 : elements;
    free(request);
    return code;
}

int moekit_mpi_improbe(const struct moekit_mpi_comm *comm, int src, int tag, int kind, int *found,
                       struct moekit_mpi_message **message, int64_t *count) {
    MPI_Message matched;
    MPI_Status status;
    int code = MPI_Improbe(src, tag, comm->comm, found, &matched, &status);
    if (code != MPI_SUCCESS || !*found) {
        return code;
    }
    int elements = 0;
    code = MPI_Get_count(&status, datatype(kind), &elements);
    if (code != MPI_SUCCESS) {
        return code;
    }
    *count = elements == MPI_UNDEFINED ? -1 : elements;
    *message = malloc(sizeof **message);
    if (*message == NULL) {
        return MOEKIT_MPI_NO_MEMORY;
    }
    (*message)->message = matched;
    return MPI_SUCCESS;
}

int moekit_mpi_imrecv(void *buffer, int count, int kind, struct moekit_mpi_message *message,
                      struct moekit_mpi_request **out) {
    int code = new_request(out);
    if (code != MPI_SUCCESS) {
        return code;
    }
    code = MPI_Imrecv(buffer, count, datatype(kind), &message->message, &(*out)->request);
    free(message);
    return code;
}
