//! The Neuron runtime's `NRT_STATUS` codes by name, as the public API reference lists them.

/// Every documented status code with its name (without the `NRT_` prefix).
const NAMES: &[(u32, &str)] = &[
    (0, "SUCCESS"),
    (1, "FAILURE"),
    (2, "INVALID"),
    (3, "INVALID_HANDLE"),
    (4, "RESOURCE"),
    (5, "TIMEOUT"),
    (6, "HW_ERROR"),
    (7, "QUEUE_FULL"),
    (9, "LOAD_NOT_ENOUGH_NC"),
    (10, "UNSUPPORTED_NEFF_VERSION"),
    (11, "FAIL_HOST_MEM_ALLOC"),
    (13, "UNINITIALIZED"),
    (14, "CLOSED"),
    (15, "QUEUE_EMPTY"),
    (101, "EXEC_UNIT_UNRECOVERABLE"),
    (1002, "EXEC_BAD_INPUT"),
    (1003, "EXEC_COMPLETED_WITH_NUM_ERR"),
    (1004, "EXEC_COMPLETED_WITH_ERR"),
    (1005, "EXEC_NC_BUSY"),
    (1006, "EXEC_OOB"),
    (1100, "COLL_PENDING"),
    (1200, "EXEC_HW_ERR_COLLECTIVES"),
    (1201, "EXEC_HW_ERR_HBM_UE"),
    (1202, "EXEC_HW_ERR_NC_UE"),
    (1203, "EXEC_HW_ERR_DMA_ABORT"),
    (1204, "EXEC_SW_NQ_OVERFLOW"),
    (1205, "EXEC_HW_ERR_REPAIRABLE_HBM_UE"),
    (1206, "NETWORK_PROXY_FAILURE"),
];

/// A status code returned by a runtime call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status(pub u32);

impl Status {
    pub const SUCCESS: Status = Status(0);
    pub const INVALID: Status = Status(2);
    pub const INVALID_HANDLE: Status = Status(3);
    pub const UNSUPPORTED_NEFF_VERSION: Status = Status(10);
    pub const CLOSED: Status = Status(14);
    pub const EXEC_BAD_INPUT: Status = Status(1002);
    pub const EXEC_OOB: Status = Status(1006);

    /// The documented name, e.g. `NRT_EXEC_OOB`, or `NRT_STATUS(n)` for an undocumented code.
    pub fn name(self) -> String {
        match NAMES.iter().find(|(code, _)| *code == self.0) {
            Some((_, name)) => format!("NRT_{name}"),
            None => format!("NRT_STATUS({})", self.0),
        }
    }

    /// Every documented status code, for listings and tests.
    pub fn all() -> impl Iterator<Item = Status> {
        NAMES.iter().map(|&(code, _)| Status(code))
    }
}
