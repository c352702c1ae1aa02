//! The safetensors reader on hostile bytes: arbitrary files, and valid files with bytes
//! flipped, truncated or extended, are read or refused with an error, never a panic, an abort
//! or an allocation sized by a corrupt header; a file read back is the one written.

mod common;

use common::*;
use moekit::Tensor;
use moekit_tools::golden::TensorFile;
use proptest::prelude::*;

/// A fresh folder of its own for each case of `test`.
fn case_dir(test: &str) -> std::path::PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static CASES: AtomicUsize = AtomicUsize::new(0);
    scratch_dir(
        "golden",
        &format!("{test}-{}", CASES.fetch_add(1, Ordering::Relaxed)),
    )
}

/// A valid file of a few tensors of every dtype, from `seed`.
fn valid_file(seed: u64) -> TensorFile {
    let mut rng = SeededRng::new(seed);
    let mut tensors = std::collections::BTreeMap::new();
    for (n, name) in ["x", "w", "expert_index"].into_iter().enumerate() {
        let shape = [1 + rng.below(4), 1 + rng.below(5)];
        let len = shape[0] * shape[1];
        let tensor = match n {
            0 => f32_tensor(&shape, &rng.values(len, 1.0)),
            1 => f32_tensor(&shape, &rng.values(len, 1.0)).to_bf16(),
            _ => Tensor::from_i32(shape, (0..len).map(|_| rng.below(9) as i32).collect()).unwrap(),
        };
        tensors.insert(name.to_owned(), tensor);
    }
    TensorFile {
        tensors,
        metadata: [("kernel".to_owned(), "permute".to_owned())].into(),
    }
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn arbitrary_bytes_are_read_or_refused(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let dir = case_dir("arbitrary");
        let path = dir.join("bytes.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        let _ = TensorFile::read(&path);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn damaged_files_are_read_or_refused(
        seed in any::<u64>(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        cut in any::<prop::sample::Index>(),
        damage in 0usize..3,
    ) {
        let dir = case_dir("damaged");
        let path = dir.join("file.safetensors");
        let file = valid_file(seed);
        file.write(&path).unwrap();
        prop_assert_eq!(&TensorFile::read(&path).unwrap(), &file);
        let mut bytes = std::fs::read(&path).unwrap();
        match damage {
            // Bytes flipped anywhere: the header's length, its JSON, the data.
            0 => {
                for (at, value) in &flips {
                    let i = at.index(bytes.len());
                    bytes[i] ^= value | 1;
                }
            }
            // Truncated.
            1 => bytes.truncate(cut.index(bytes.len())),
            // Extended past the data the header describes.
            _ => bytes.extend_from_slice(&[0xAB; 7]),
        }
        std::fs::write(&path, &bytes).unwrap();
        let _ = TensorFile::read(&path);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
