//! Reading the files a user names (job configs, model configs, data, checkpoints, tokens)
//! with bounds: a device, a pipe or a folder is an error rather than an endless read, and the
//! memory for a file's size is reserved, or refused, before reading.

use std::path::Path;

use anyhow::{Context, Result, anyhow};

/// The bytes of the regular file at `path` (errors name it).
pub fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    // moekit's error already ends with its cause: as one message, so `{:#}` does not repeat it.
    moekit::golden::read_regular_file(path).map_err(|err| anyhow!("{err}"))
}

/// The UTF-8 text of the regular file at `path`.
pub fn read_text(path: &Path) -> Result<String> {
    String::from_utf8(read_bytes(path)?)
        .with_context(|| format!("{} is not UTF-8 text", path.display()))
}
