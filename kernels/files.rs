//! Reading files whose size the input decides (NEFFs, tensor files) without trusting them: only
//! regular files, into memory reserved up front.

use std::fs;
use std::path::Path;

use crate::error::{Error, Result};

/// The whole of the regular file at `path`, read into memory reserved for its size first: a
/// device, a pipe or a folder is an error (an endless input is never read), and so is a file
/// whose size cannot be allocated.
pub fn read_regular_file(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    let io = |error| Error::Io {
        path: path.to_owned(),
        error,
    };
    // The type is checked before opening: opening a FIFO without a writer blocks.
    if !fs::metadata(path).map_err(io)?.is_file() {
        return Err(Error::Format {
            path: path.to_owned(),
            message: "not a regular file".to_owned(),
        });
    }
    let file = fs::File::open(path).map_err(io)?;
    let metadata = file.metadata().map_err(io)?;
    let len = usize::try_from(metadata.len()).unwrap_or(usize::MAX);
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(len)
        .map_err(|error| Error::Allocation {
            what: format!("the {len} bytes of {}", path.display()),
            error,
        })?;
    // The file may have grown since: read no more than its size then.
    file.take(len as u64).read_to_end(&mut bytes).map_err(io)?;
    Ok(bytes)
}
