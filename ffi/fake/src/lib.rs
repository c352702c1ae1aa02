//! A fake Neuron runtime for tests: `fake_nrt.c` (see its header comment and `ffi/README.md`)
//! compiled into shared libraries that export libnrt's symbols, so the bindings and the
//! `neuron` backend are exercised end to end on any machine.

/// `libnrt_fake.so`: every call moekit binds.
pub const LIBRARY: &str = env!("MOEKIT_FAKE_NRT");

/// `libnrt_fake_partial.so`: the same without `nrt_execute_repeat`, as older runtimes.
pub const LIBRARY_WITHOUT_EXECUTE_REPEAT: &str = env!("MOEKIT_FAKE_NRT_PARTIAL");
