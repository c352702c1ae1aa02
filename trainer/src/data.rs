//! Training data: text tokenized byte by byte or by a Hugging Face `tokenizer.json`, cut into
//! packed `seq_len` windows, served in batches in a seeded shuffled order that is reshuffled
//! every epoch.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, ensure};
use moekit::random::SplitMix64;
use tch::Tensor;

/// How text becomes token ids.
pub enum TextTokenizer {
    /// One token per UTF-8 byte (ids 0–255).
    Byte,
    /// A Hugging Face `tokenizer.json` (Qwen's, or any other), without special tokens added,
    /// and the file's bytes (saved into checkpoints beside the model they tokenize for).
    HuggingFace {
        tokenizer: Box<tokenizers::Tokenizer>,
        json: Vec<u8>,
    },
}

impl TextTokenizer {
    /// `"byte"`, or the path of a `tokenizer.json`.
    pub fn load(spec: &str) -> Result<Self> {
        if spec == "byte" {
            return Ok(Self::Byte);
        }
        let path = Path::new(spec);
        let bytes = crate::files::read_bytes(path)
            .with_context(|| format!("cannot load tokenizer {}", path.display()))?;
        let mut tokenizer = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| anyhow!("cannot load tokenizer {}: {e}", path.display()))?;
        // A file's own truncation or padding would cut or pad each whole data file (encoded
        // as one sequence); the data is windowed into `seq_len` tokens here instead.
        tokenizer
            .with_truncation(None)
            .map_err(|e| anyhow!("cannot load tokenizer {}: {e}", path.display()))?;
        tokenizer.with_padding(None);
        Ok(Self::HuggingFace {
            tokenizer: Box::new(tokenizer),
            json: bytes,
        })
    }

    /// The `tokenizer.json` it was loaded from; none at byte level.
    pub fn json(&self) -> Option<&[u8]> {
        match self {
            Self::Byte => None,
            Self::HuggingFace { json, .. } => Some(json),
        }
    }

    /// Number of token ids it can produce (added tokens included).
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Byte => 256,
            Self::HuggingFace { tokenizer, .. } => tokenizer.get_vocab_size(true),
        }
    }

    /// The token ids of `text`.
    pub fn encode(&self, text: &str) -> Result<Vec<i64>> {
        match self {
            Self::Byte => Ok(text.bytes().map(i64::from).collect()),
            Self::HuggingFace { tokenizer, .. } => Ok(tokenizer
                .encode(text, false)
                .map_err(|e| anyhow!("cannot tokenize: {e}"))?
                .get_ids()
                .iter()
                .map(|&id| i64::from(id))
                .collect()),
        }
    }

    /// The text of `ids`. Byte level, the ids are UTF-8 bytes (an invalid sequence, or an id
    /// above 255 that a larger vocabulary allows, shows as U+FFFD); a `tokenizer.json` decodes
    /// them without its special tokens.
    pub fn decode(&self, ids: &[i64]) -> Result<String> {
        match self {
            Self::Byte => {
                let mut bytes = Vec::with_capacity(ids.len());
                for &id in ids {
                    match u8::try_from(id) {
                        Ok(byte) => bytes.push(byte),
                        Err(_) => bytes.extend_from_slice("\u{FFFD}".as_bytes()),
                    }
                }
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Self::HuggingFace { tokenizer, .. } => {
                let ids = ids
                    .iter()
                    .map(|&id| u32::try_from(id).with_context(|| format!("token id {id}")))
                    .collect::<Result<Vec<u32>>>()?;
                tokenizer
                    .decode(&ids, true)
                    .map_err(|e| anyhow!("cannot decode token ids: {e}"))
            }
        }
    }
}

/// A deterministic corpus of simple English sentences (about `bytes` long) built from a small
/// grammar: structured enough that a tiny model visibly learns it within a minute.
pub fn builtin_corpus(bytes: usize) -> String {
    const SUBJECTS: &[&str] = &[
        "the cat",
        "a dog",
        "the old sailor",
        "my sister",
        "the small bird",
        "a farmer",
        "the teacher",
        "our neighbour",
        "the red fox",
        "a child",
    ];
    const VERBS: &[&str] = &[
        "sees",
        "finds",
        "follows",
        "paints",
        "watches",
        "carries",
        "remembers",
        "visits",
    ];
    const OBJECTS: &[&str] = &[
        "the river",
        "a green apple",
        "the quiet house",
        "a long letter",
        "the bright moon",
        "an empty boat",
        "the wooden bridge",
        "a warm loaf of bread",
    ];
    const ENDINGS: &[&str] = &[
        "in the morning",
        "after the rain",
        "before dinner",
        "near the market",
        "every day",
        "at night",
    ];
    let mut rng = SplitMix64::new(0x6d6f_656b_6974);
    let mut text = String::with_capacity(bytes + 128);
    while text.len() < bytes {
        let pick = |rng: &mut SplitMix64, words: &[&'static str]| words[rng.below(words.len())];
        let subject = pick(&mut rng, SUBJECTS);
        let verb = pick(&mut rng, VERBS);
        let object = pick(&mut rng, OBJECTS);
        let ending = pick(&mut rng, ENDINGS);
        text.push_str(subject);
        text.push(' ');
        text.push_str(verb);
        text.push(' ');
        text.push_str(object);
        text.push(' ');
        text.push_str(ending);
        text.push_str(".\n");
    }
    text
}

/// Where the text comes from.
#[derive(Clone, Debug)]
pub enum Source {
    /// [`builtin_corpus`] of this many bytes.
    Builtin(usize),
    /// These files, concatenated in order.
    Files(Vec<PathBuf>),
}

impl Source {
    /// The token ids of the whole source.
    pub fn tokens(&self, tokenizer: &TextTokenizer) -> Result<Vec<i64>> {
        match self {
            Source::Builtin(bytes) => tokenizer.encode(&builtin_corpus(*bytes)),
            Source::Files(files) => {
                let mut tokens = Vec::new();
                for file in files {
                    let text = crate::files::read_text(file)
                        .with_context(|| format!("cannot read training text {}", file.display()))?;
                    tokens.extend(
                        tokenizer
                            .encode(&text)
                            .with_context(|| format!("in {}", file.display()))?,
                    );
                }
                Ok(tokens)
            }
        }
    }
}

/// Batches of `[batch_size, seq_len]` token windows in a seeded order, reshuffled each epoch.
pub struct Batches {
    tokens: Vec<i64>,
    seq_len: usize,
    batch_size: usize,
    seed: u64,
    epoch: u64,
    /// Window order of the current epoch.
    order: Vec<usize>,
    /// Next position in `order`.
    cursor: usize,
}

impl Batches {
    /// Cuts `tokens` into non-overlapping `seq_len` windows (the tail shorter than a window is
    /// dropped); at least `batch_size` windows are required.
    pub fn new(tokens: Vec<i64>, seq_len: usize, batch_size: usize, seed: u64) -> Result<Self> {
        let windows = tokens.len() / seq_len.max(1);
        ensure!(
            windows >= batch_size,
            "the training text has {} tokens: {windows} windows of seq_len {seq_len}, fewer \
             than one batch of {batch_size}",
            tokens.len()
        );
        let mut batches = Self {
            tokens,
            seq_len,
            batch_size,
            seed,
            epoch: 0,
            order: Vec::new(),
            cursor: 0,
        };
        batches.shuffle();
        Ok(batches)
    }

    fn shuffle(&mut self) {
        let windows = self.tokens.len() / self.seq_len;
        let mut rng = SplitMix64::new(self.seed ^ self.epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        self.order = rng.permutation(windows);
        self.cursor = 0;
    }

    /// The position in the data order: `(epoch, cursor)`.
    pub fn position(&self) -> (u64, usize) {
        (self.epoch, self.cursor)
    }

    /// `(length, FNV-1a hash)` of the token stream, identifying the data a position refers to.
    pub fn fingerprint(&self) -> (usize, u64) {
        let hash = self
            .tokens
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |hash, &token| {
                token.to_le_bytes().iter().fold(hash, |h, &b| {
                    (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
                })
            });
        (self.tokens.len(), hash)
    }

    /// Continues from a [`Self::position`] of the same data, seed and shapes.
    pub fn seek(&mut self, epoch: u64, cursor: usize) -> Result<()> {
        self.epoch = epoch;
        self.shuffle();
        ensure!(
            cursor <= self.order.len(),
            "data position {cursor} is past the {} windows of the data",
            self.order.len()
        );
        self.cursor = cursor;
        Ok(())
    }

    /// The next `[batch_size, seq_len]` i64 batch; an epoch's last partial batch is skipped.
    pub fn next_batch(&mut self) -> Tensor {
        if self.cursor + self.batch_size > self.order.len() {
            self.epoch += 1;
            self.shuffle();
        }
        let mut batch = Vec::with_capacity(self.batch_size * self.seq_len);
        for &window in &self.order[self.cursor..self.cursor + self.batch_size] {
            let start = window * self.seq_len;
            batch.extend_from_slice(&self.tokens[start..start + self.seq_len]);
        }
        self.cursor += self.batch_size;
        Tensor::from_slice(&batch).view([self.batch_size as i64, self.seq_len as i64])
    }
}

/// Holds out the tail of `tokens` as a validation split: the last `ceil(fraction · windows)`
/// of its `seq_len` windows (at least one; a product within 1e-9 of an integer counts as that
/// integer, so 0.07 of 100 windows is 7, not the 8 that f64 rounding would give), returned
/// second; the rest, whose windows are the others, first. The two never share a window.
pub fn hold_out_tail(mut tokens: Vec<i64>, seq_len: usize, fraction: f64) -> (Vec<i64>, Vec<i64>) {
    let windows = tokens.len() / seq_len.max(1);
    let exact = fraction * windows as f64;
    let held_out = match (exact - exact.round()).abs() < 1e-9 {
        true => exact.round(),
        false => exact.ceil(),
    };
    let held_out = (held_out as usize).clamp(1, windows.max(1));
    let cut = (windows.saturating_sub(held_out) * seq_len).min(tokens.len());
    let validation = tokens.split_off(cut);
    (tokens, validation)
}

/// The validation split as fixed `[batch_size, seq_len]` batches: the first `count` batches
/// of its windows in order (fewer when the split is shorter), so every evaluation, a resumed
/// run's included, sees the same ones. At least one batch is required.
pub fn validation_batches(
    tokens: &[i64],
    seq_len: usize,
    batch_size: usize,
    count: usize,
) -> Result<Vec<Tensor>> {
    let windows = tokens.len() / seq_len.max(1);
    ensure!(
        windows >= batch_size,
        "the validation text has {} tokens: {windows} windows of seq_len {seq_len}, fewer than \
         one batch of {batch_size}",
        tokens.len()
    );
    let batch_tokens = batch_size * seq_len;
    Ok(tokens
        .chunks_exact(batch_tokens)
        .take(count)
        .map(|batch| Tensor::from_slice(batch).view([batch_size as i64, seq_len as i64]))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distinct token ids: a window's tokens name the window.
    fn distinct(n: usize) -> Vec<i64> {
        (0..n as i64).collect()
    }

    #[test]
    fn the_held_out_tail_never_reaches_a_training_batch() {
        for (tokens, seq_len, fraction, held_out) in [
            (1000, 10, 0.1, 10),
            (1005, 10, 0.1, 10),
            (1000, 10, 0.001, 1),
            (1000, 10, 0.95, 95),
            // 0.07 · 100 is 7.000000000000001 in f64: still 7 windows.
            (1000, 10, 0.07, 7),
            (1000, 10, 0.071, 8),
        ] {
            let (training, validation) = hold_out_tail(distinct(tokens), seq_len, fraction);
            assert_eq!(validation.len() / seq_len, held_out, "{tokens} {fraction}");
            assert_eq!(training.len() + validation.len(), tokens);
            // Two epochs of shuffled training batches see no validation token.
            let mut batches = Batches::new(training, seq_len, 2, 7).unwrap();
            let windows = (tokens / seq_len - held_out) / 2;
            for _ in 0..2 * windows {
                let batch = Vec::<i64>::try_from(batches.next_batch().flatten(0, 1)).unwrap();
                assert!(batch.iter().all(|t| !validation.contains(t)));
            }
        }
    }

    #[test]
    fn validation_batches_are_the_first_windows_in_order() {
        let tokens = distinct(95);
        let batches = validation_batches(&tokens, 10, 2, 3).unwrap();
        assert_eq!(batches.len(), 3);
        for (i, batch) in batches.iter().enumerate() {
            assert_eq!(batch.size(), [2, 10]);
            let values = Vec::<i64>::try_from(batch.flatten(0, 1)).unwrap();
            assert_eq!(
                values,
                (20 * i as i64..20 * (i as i64 + 1)).collect::<Vec<_>>()
            );
        }
        // Fewer batches when the split is shorter; none is an error.
        assert_eq!(validation_batches(&tokens, 10, 2, 100).unwrap().len(), 4);
        let err = validation_batches(&tokens[..15], 10, 2, 1).unwrap_err();
        assert!(
            err.to_string().contains("fewer than one batch of 2"),
            "{err}"
        );
    }
}
