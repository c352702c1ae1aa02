//! A fake Neuron runtime for tests: `fake_nrt.c` (see its header comment and `ffi/README.md`)
//! compiled into shared libraries that export libnrt's symbols, so the bindings and the
//! `neuron` backend are exercised end to end on any machine.

/// `libnrt_fake.so`: every call moekit binds.
pub const LIBRARY: &str = env!("MOEKIT_FAKE_NRT");

/// `libnrt_fake_partial.so`: the same without `nrt_execute_repeat`, as older runtimes.
pub const LIBRARY_WITHOUT_EXECUTE_REPEAT: &str = env!("MOEKIT_FAKE_NRT_PARTIAL");

/// The sizes and options of a blockwise kernel's stand-in NEFF: `blockwise_mm` or
/// `blockwise_mm_bwd` at T tokens (rows: T with `skip_token`, T+1 without), H, E, I, B and N
/// blocks, every float tensor f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blockwise<'a> {
    pub t: usize,
    pub h: usize,
    pub e: usize,
    pub i: usize,
    pub b: usize,
    pub n: usize,
    /// An `ActFnType` member (`SiLU`, …).
    pub activation: &'a str,
    /// An `ExpertAffinityScaleMode` member (`POST_SCALE`, …).
    pub scaling: &'a str,
    pub skip_token: bool,
    /// The forward's checkpoint outputs (the backward takes them regardless).
    pub checkpoint: bool,
}

impl Blockwise<'_> {
    fn rows(&self) -> usize {
        if self.skip_token { self.t } else { self.t + 1 }
    }

    /// The header and the inputs both kernels share.
    fn common(&self, kernel: &str) -> String {
        let (rows, h, e, i, b, n) = (self.rows(), self.h, self.e, self.i, self.b, self.n);
        let mut text = format!(
            "moekit-fake-neff 1\nkernel {kernel}\nparam activation_function {}\n\
             param expert_affinities_scaling_mode {}\nparam skip_token {}\n",
            self.activation,
            self.scaling,
            u8::from(self.skip_token)
        );
        text += &declare("input", "hidden_states", "f32", &[rows, h]);
        text += &declare("input", "expert_affinities_masked", "f32", &[rows * e, 1]);
        text += &declare("input", "gate_up_proj_weight", "f32", &[e, h, 2, i]);
        text += &declare("input", "down_proj_weight", "f32", &[e, i, h]);
        text += &declare("input", "token_position_to_id", "i32", &[n * b]);
        text += &declare("input", "block_to_expert", "i32", &[n, 1]);
        text
    }

    /// The stand-in of a `blockwise_mm` NEFF without biases.
    pub fn forward_neff(&self) -> String {
        let (rows, h, i, b, n) = (self.rows(), self.h, self.i, self.b, self.n);
        let mut text = self.common("blockwise_mm");
        text += &declare("output", "output", "f32", &[rows, h]);
        if self.checkpoint {
            text += &declare("output", "gate_up_activations_T", "f32", &[n, 2, i, b]);
            text += &declare("output", "down_activations", "f32", &[n, b, h]);
        }
        text
    }

    /// The stand-in of a `blockwise_mm_bwd` NEFF without bias gradients.
    pub fn backward_neff(&self) -> String {
        let (rows, h, e, i, b, n) = (self.rows(), self.h, self.e, self.i, self.b, self.n);
        let mut text = self.common("blockwise_mm_bwd");
        text += &declare(
            "input",
            "gate_up_proj_act_checkpoint_T",
            "f32",
            &[n, 2, i, b],
        );
        text += &declare("input", "down_proj_act_checkpoint", "f32", &[n, b, h]);
        text += &declare("input", "output_hidden_states_grad", "f32", &[rows, h]);
        text += &declare("output", "hidden_states_grad", "f32", &[rows, h]);
        text += &declare(
            "output",
            "expert_affinities_masked_grad",
            "f32",
            &[rows * e, 1],
        );
        text += &declare("output", "gate_up_proj_weight_grad", "f32", &[e, h, 2, i]);
        text += &declare("output", "down_proj_weight_grad", "f32", &[e, i, h]);
        text
    }
}

/// One tensor line of a stand-in NEFF: usage, name, dtype, dimensions.
fn declare(usage: &str, name: &str, dtype: &str, shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    format!("{usage} {name} {dtype} {}\n", dims.join(" "))
}
