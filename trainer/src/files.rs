//! Files: reading the files a user names (job configs, model configs, data, checkpoints,
//! tokens) with bounds: a device, a pipe or a folder is an error rather than an endless read,
//! and the memory for a file's size is reserved, or refused, before reading; and writing
//! tensor files, JSON and whole folders atomically (a temporary beside the destination,
//! renamed into place), so nothing a run saved is ever half-written.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, anyhow, ensure};
use moekit_tools::golden::{TensorFile, write_atomically};
use moekit_tools::torch::{from_tch, to_tch};
use serde::Serialize;
use tch::{Kind, Tensor};

/// The bytes of the regular file at `path` (errors name it).
pub fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    // moekit's error already ends with its cause: as one message, so `{:#}` does not repeat it.
    moekit::files::read_regular_file(path).map_err(|err| anyhow!("{err}"))
}

/// The UTF-8 text of the regular file at `path`.
pub fn read_text(path: &Path) -> Result<String> {
    String::from_utf8(read_bytes(path)?)
        .with_context(|| format!("{} is not UTF-8 text", path.display()))
}

/// Copies `values` into the parameters (same names), converting each from f32 or bf16 to its
/// parameter's dtype; `source` names where the values come from.
pub(crate) fn assign(
    params: &[(String, Tensor)],
    source: &Path,
    values: impl Fn(&str, &[i64]) -> Result<Tensor>,
) -> Result<()> {
    let loaded = params
        .iter()
        .map(|(name, p)| {
            let value = values(name, &p.size())?;
            ensure!(
                matches!(value.kind(), Kind::Float | Kind::BFloat16),
                "{}: tensor for `{name}` holds {:?} values; parameters load from f32 or bf16",
                source.display(),
                value.kind()
            );
            Ok(value)
        })
        .collect::<Result<Vec<_>>>()?;
    tch::no_grad(|| {
        for ((_, p), value) in params.iter().zip(loaded) {
            p.shallow_clone().copy_(&value.to_kind(p.kind()));
        }
    });
    Ok(())
}

/// Reads every tensor of a safetensors file into libtorch tensors.
pub(crate) fn read_tensors(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    let file = TensorFile::read(path)?;
    Ok(file
        .tensors
        .iter()
        .map(|(name, t)| (name.clone(), to_tch(t)))
        .collect())
}

/// Writes libtorch tensors as one safetensors file (atomically).
pub(crate) fn write_tensors(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
    let mut file = TensorFile::default();
    for (name, tensor) in tensors {
        file.tensors.insert(name.clone(), from_tch(name, tensor)?);
    }
    file.write(path)?;
    Ok(())
}

/// Builds a folder at `dir` (which must not exist) by filling a temporary sibling with `fill`
/// and renaming it into place; on failure the temporary folder is removed.
pub(crate) fn write_folder(dir: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    ensure!(
        !dir.exists(),
        "{} already exists; choose another path or remove it first",
        dir.display()
    );
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    // Folders that writes killed mid-way left here, `<name>.tmp-<pid>` of a process now gone.
    moekit_tools::golden::remove_stale_temporaries(dir);
    let mut tmp_name = dir.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = dir.with_file_name(tmp_name);
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let result = fill(&tmp).and_then(|()| {
        std::fs::rename(&tmp, dir)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), dir.display()))
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

pub(crate) fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    write_atomically(path, text.as_bytes())?;
    Ok(())
}
