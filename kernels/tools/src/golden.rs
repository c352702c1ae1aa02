//! Golden-tensor files: named tensors in safetensors format, the exchange format between moekit
//! and other implementations (an NKI kernel's harness, PyTorch). f32, bf16 and i32 tensors are
//! read, and u32 index tensors (as nki-library's tests store `expert_index`) as i32; files are
//! written atomically (temporary file, then rename), so an existing file is never left
//! half-written. Only regular files are read, into memory reserved up front (a file too large
//! for it is an error, not an abort), and a header that names a tensor twice is refused.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use half::bf16;
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};

use moekit::error::{Error, Result};
use moekit::files::read_regular_file;
use moekit::tensor::{DType, Tensor};

/// Tensors by name plus the file's string metadata (`__metadata__`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TensorFile {
    pub tensors: BTreeMap<String, Tensor>,
    pub metadata: HashMap<String, String>,
}

fn format_error(path: &Path, message: impl Into<String>) -> Error {
    Error::Format {
        path: path.to_owned(),
        message: message.into(),
    }
}

fn words<const N: usize>(bytes: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
    bytes
        .chunks_exact(N)
        .map(|chunk| chunk.try_into().expect("chunks_exact yields N bytes"))
}

fn to_tensor(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Tensor> {
    let shape = view.shape().to_vec();
    let bytes = view.data();
    let tensor = match view.dtype() {
        StDtype::F32 => Tensor::from_f32(shape, words(bytes).map(f32::from_le_bytes).collect()),
        StDtype::BF16 => Tensor::from_bf16(shape, words(bytes).map(bf16::from_le_bytes).collect()),
        StDtype::I32 => Tensor::from_i32(shape, words(bytes).map(i32::from_le_bytes).collect()),
        StDtype::U32 => {
            let values: Vec<u32> = words(bytes).map(u32::from_le_bytes).collect();
            if let Some(index) = values.iter().position(|&v| i32::try_from(v).is_err()) {
                return Err(format_error(
                    path,
                    format!(
                        "tensor `{name}`: u32 value {} at {} does not fit in i32 (moekit reads \
                         u32 indices as i32)",
                        values[index],
                        moekit::tensor::position(&shape, index)
                    ),
                ));
            }
            Tensor::from_i32(shape, values.into_iter().map(|v| v as i32).collect())
        }
        other => {
            return Err(format_error(
                path,
                format!("tensor `{name}` has dtype {other:?}; moekit reads F32, BF16, I32 and U32"),
            ));
        }
    };
    tensor.map_err(|e| format_error(path, format!("tensor `{name}`: {e}")))
}

impl TensorFile {
    /// Reads every tensor and the metadata of a safetensors file.
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = read_regular_file(path)?;
        let (header_len, header) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| format_error(path, format!("not a valid safetensors file: {e}")))?;
        // The header is valid JSON (`read_metadata` parsed it), but a map that names a tensor
        // twice parses to its last entry: refused here.
        let json = &bytes[8..8 + header_len];
        if let Some(name) = repeated_key(json) {
            return Err(format_error(
                path,
                format!("the header declares tensor `{name}` more than once"),
            ));
        }
        let parsed = SafeTensors::deserialize(&bytes)
            .map_err(|e| format_error(path, format!("not a valid safetensors file: {e}")))?;
        let mut tensors = BTreeMap::new();
        for (name, view) in parsed.tensors() {
            let tensor = to_tensor(path, &name, &view)?;
            tensors.insert(name, tensor);
        }
        Ok(Self {
            tensors,
            metadata: header.metadata().clone().unwrap_or_default(),
        })
    }

    /// Writes the tensors and metadata atomically: to a temporary file beside `path`, then
    /// renamed over it. The tensors are written from where they lie, without a copy of the file in
    /// memory.
    pub fn write(&self, path: &Path) -> Result<()> {
        let bytes: Vec<_> = self.tensors.values().map(Tensor::le_bytes).collect();
        let mut views = Vec::with_capacity(self.tensors.len());
        for ((name, tensor), bytes) in self.tensors.iter().zip(&bytes) {
            let dtype = match tensor.dtype() {
                DType::F32 => StDtype::F32,
                DType::BF16 => StDtype::BF16,
                DType::I32 => StDtype::I32,
            };
            let view = TensorView::new(dtype, tensor.shape().to_vec(), bytes)
                .map_err(|e| format_error(path, format!("tensor `{name}`: {e}")))?;
            views.push((name.as_str(), view));
        }
        let metadata = (!self.metadata.is_empty()).then(|| self.metadata.clone());
        write_atomically_with(path, |tmp| {
            safetensors::serialize_to_file(views, metadata, tmp)
                .map_err(|e| format_error(path, format!("cannot write: {e}")))
        })
    }
}

/// The first key a JSON object names twice, if any (`json` must be a valid JSON object).
fn repeated_key(json: &[u8]) -> Option<String> {
    use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
    struct FirstRepeat;
    impl<'de> Visitor<'de> for FirstRepeat {
        type Value = Option<String>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }

        fn visit_map<A: MapAccess<'de>>(
            self,
            mut map: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let mut seen = std::collections::HashSet::new();
            let mut repeated = None;
            while let Some(key) = map.next_key::<String>()? {
                map.next_value::<IgnoredAny>()?;
                if !seen.insert(key.clone()) && repeated.is_none() {
                    repeated = Some(key);
                }
            }
            Ok(repeated)
        }
    }
    serde_json::Deserializer::from_slice(json)
        .deserialize_map(FirstRepeat)
        .ok()
        .flatten()
}

/// Writes `bytes` to a temporary file beside `path`, syncs it, and renames it over `path`.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomically_with(path, |tmp| {
        fs::write(tmp, bytes).map_err(|error| Error::Io {
            path: tmp.to_owned(),
            error,
        })
    })
}

/// Removes what writes of `path` by processes that are no longer running left beside it: the
/// files and folders named `<name>.tmp-<pid>` or `<name>.tmp-<pid>-<n>` (the temporaries of
/// [`write_atomically`] and of the trainer's folder writes) whose process `pid` is gone, as
/// after a kill mid-write. A running process's temporaries, and every other entry, are left
/// alone. Returns what was removed.
pub fn remove_stale_temporaries(path: &Path) -> Vec<PathBuf> {
    let (Some(name), Some(parent)) = (path.file_name(), path.parent()) else {
        return Vec::new();
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    remove_stale_temporaries_named(parent, &format!("{}.tmp-", name.to_string_lossy()), "")
}

/// Removes the entries of `dir` named `{prefix}<pid>{suffix}` or `{prefix}<pid>-<n>{suffix}`
/// whose process `pid` is gone ([`remove_stale_temporaries`] for temporaries named otherwise).
pub fn remove_stale_temporaries_named(dir: &Path, prefix: &str, suffix: &str) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let entry_name = entry.file_name();
        let Some(middle) = entry_name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(|n| n.strip_suffix(suffix))
        else {
            continue;
        };
        let mut parts = middle.splitn(2, '-');
        let pid = parts.next().and_then(|p| p.parse::<u32>().ok());
        let count_ok = parts.next().is_none_or(|n| n.parse::<u64>().is_ok());
        if !pid.is_some_and(|pid| count_ok && !process_is_running(pid)) {
            continue;
        }
        let stale = entry.path();
        let gone = match entry.file_type() {
            Ok(kind) if kind.is_dir() => fs::remove_dir_all(&stale),
            _ => fs::remove_file(&stale),
        };
        if gone.is_ok() {
            removed.push(stale);
        }
    }
    removed
}

/// Whether process `pid` exists (on platforms where that cannot be asked: assumed so).
fn process_is_running(pid: u32) -> bool {
    #[cfg(unix)]
    {
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            return true;
        };
        // SAFETY: signal 0 only checks that the process exists and may be signalled; nothing
        // is sent.
        let status = unsafe { libc::kill(pid, 0) };
        status == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// Has `write` create a temporary file beside `path` (`<name>.tmp-<pid>-<n>`, n counting this
/// process's writes, so threads writing the same path never share one), syncs it, and renames
/// it over `path`; the temporary file is removed if anything fails. Temporaries that killed
/// writers left beside `path` are removed first ([`remove_stale_temporaries`]).
fn write_atomically_with(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    remove_stale_temporaries(path);
    use std::sync::atomic::{AtomicU64, Ordering};
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let io = |path: &Path| {
        let path = path.to_owned();
        move |error| Error::Io { path, error }
    };
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    tmp_name.push(format!(".tmp-{}-{n}", std::process::id()));
    let tmp: PathBuf = path.with_file_name(tmp_name);
    let result = (|| {
        write(&tmp)?;
        fs::File::open(&tmp)
            .and_then(|file| file.sync_all())
            .map_err(io(&tmp))?;
        fs::rename(&tmp, path).map_err(io(path))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh folder for one test's files.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("moekit-golden-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A safetensors file from a header written out by hand and the data bytes.
    fn raw_file(path: &Path, header: &str, data: &[u8]) {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(data);
        fs::write(path, bytes).unwrap();
    }

    #[test]
    fn a_write_removes_only_the_temporaries_of_writers_that_are_gone() {
        let dir = scratch("stale");
        // A process that has exited: its pid names no running process.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        child.wait().unwrap();
        let (gone, alive) = (child.id(), std::process::id());
        let path = dir.join("x.safetensors");
        let stale_file = dir.join(format!("x.safetensors.tmp-{gone}-3"));
        let stale_folder = dir.join(format!("x.safetensors.tmp-{gone}"));
        let kept = [
            dir.join(format!("x.safetensors.tmp-{alive}-9")),
            dir.join("x.safetensors.tmp-notapid-1"),
            dir.join(format!("x.safetensors.tmp-{gone}-3-extra")),
            dir.join(format!("y.safetensors.tmp-{gone}-0")),
            dir.join(format!("x.safetensors.bak-{gone}")),
        ];
        fs::write(&stale_file, b"half").unwrap();
        fs::create_dir_all(stale_folder.join("inner")).unwrap();
        fs::write(stale_folder.join("inner/model.safetensors"), b"half").unwrap();
        for other in &kept {
            fs::write(other, b"keep").unwrap();
        }
        write_atomically(&path, b"new").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new");
        assert!(!stale_file.exists() && !stale_folder.exists());
        for other in &kept {
            assert_eq!(fs::read(other).unwrap(), b"keep", "{}", other.display());
        }
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn u32_indices_are_read_as_i32_and_values_past_i32_are_errors() {
        let dir = scratch("u32");
        let path = dir.join("index.safetensors");
        let data: Vec<u8> = [3u32, 0, 7].iter().flat_map(|v| v.to_le_bytes()).collect();
        raw_file(
            &path,
            r#"{"expert_index":{"dtype":"U32","shape":[3,1],"data_offsets":[0,12]}}"#,
            &data,
        );
        let file = TensorFile::read(&path).unwrap();
        assert_eq!(
            file.tensors["expert_index"],
            Tensor::from_i32([3, 1], vec![3, 0, 7]).unwrap()
        );
        let data: Vec<u8> = [1u32, 1 << 31]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        raw_file(
            &path,
            r#"{"expert_index":{"dtype":"U32","shape":[2],"data_offsets":[0,8]}}"#,
            &data,
        );
        let err = TensorFile::read(&path).unwrap_err().to_string();
        assert!(
            err.contains("`expert_index`") && err.contains("2147483648") && err.contains("[1]"),
            "{err}"
        );
    }

    #[test]
    fn a_tensor_declared_twice_is_an_error_naming_it() {
        let dir = scratch("repeated");
        let path = dir.join("twice.safetensors");
        let header = r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"x":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]}}"#;
        raw_file(&path, header, &[0; 8]);
        let err = TensorFile::read(&path).unwrap_err().to_string();
        assert!(err.contains("declares tensor `x` more than once"), "{err}");
        // One declaration reads.
        let once = r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        raw_file(&path, once, &[0; 8]);
        assert_eq!(TensorFile::read(&path).unwrap().tensors.len(), 1);
    }

    #[test]
    fn written_files_read_back_exactly_and_leave_no_temporary_file() {
        let dir = scratch("round-trip");
        let path = dir.join("out.safetensors");
        let x = Tensor::from_f32([2, 3], vec![1.5, -0.0, 3.25, f32::MIN, 7.0, 1e-30]).unwrap();
        let file = TensorFile {
            tensors: [
                ("x".to_owned(), x.clone()),
                ("x_bf16".to_owned(), x.to_bf16()),
                (
                    "ids".to_owned(),
                    Tensor::from_i32([3], vec![-1, 0, 9]).unwrap(),
                ),
            ]
            .into_iter()
            .collect(),
            metadata: [("kernel".to_owned(), "permute".to_owned())].into(),
        };
        file.write(&path).unwrap();
        assert_eq!(TensorFile::read(&path).unwrap(), file);
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["out.safetensors"]);
    }

    #[test]
    fn only_regular_files_are_read() {
        let dir = scratch("regular");
        for path in [Path::new("/dev/zero"), dir.as_path()] {
            let err = TensorFile::read(path).unwrap_err().to_string();
            assert!(err.contains("not a regular file"), "{err}");
        }
    }
}
