//! Golden-tensor files: named tensors in safetensors format, the exchange format between moekit
//! and other implementations (an NKI kernel's harness, PyTorch). f32, bf16 and i32 tensors are
//! read; files are written atomically (temporary file, then rename), so an existing file is never
//! left half-written.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use half::bf16;
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};

use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

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
        other => {
            return Err(format_error(
                path,
                format!("tensor `{name}` has dtype {other:?}; moekit reads F32, BF16 and I32"),
            ));
        }
    };
    tensor.map_err(|e| format_error(path, format!("tensor `{name}`: {e}")))
}

impl TensorFile {
    /// Reads every tensor and the metadata of a safetensors file.
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = fs::read(path).map_err(|source| Error::Io {
            path: path.to_owned(),
            source,
        })?;
        let (_, header) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| format_error(path, format!("not a valid safetensors file: {e}")))?;
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

    /// Writes the tensors and metadata atomically: to `<path>.tmp-<pid>`, then renamed over
    /// `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        let buffers: Vec<(String, Vec<u8>, &Tensor)> = self
            .tensors
            .iter()
            .map(|(name, tensor)| (name.clone(), tensor.to_le_bytes(), tensor))
            .collect();
        let mut views = Vec::with_capacity(buffers.len());
        for (name, bytes, tensor) in &buffers {
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
        let bytes = safetensors::serialize(views, metadata)
            .map_err(|e| format_error(path, format!("cannot serialize: {e}")))?;
        write_atomically(path, &bytes)
    }
}

/// Writes `bytes` to a temporary file beside `path`, syncs it, and renames it over `path`.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| Error::Io { path, source }
    };
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp: PathBuf = path.with_file_name(tmp_name);
    let result = (|| {
        use std::io::Write;
        let mut file = fs::File::create(&tmp).map_err(io(&tmp))?;
        file.write_all(bytes).map_err(io(&tmp))?;
        file.sync_all().map_err(io(&tmp))?;
        fs::rename(&tmp, path).map_err(io(path))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}
