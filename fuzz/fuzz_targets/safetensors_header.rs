//! The safetensors reader (checkpoints, Hugging Face weights, eval dumps): a file opened as
//! `Mapped::open` does, its metadata, and every tensor's type and conversion to f32 as the
//! loaders read them. Anything may be refused; no input may panic, hang or overflow.
#![no_main]

use engine::tensors::{Mapped, float_type, read_f32};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("fuzz-safetensors-{}", std::process::id()));
    std::fs::write(&path, data).unwrap();
    let Ok(file) = Mapped::open(&path) else { return };
    let _ = file.metadata();
    for (name, view) in file.tensors().tensors() {
        if float_type(&name, &view).is_err() {
            continue;
        }
        // The loaders size the output from the model; here from the file, which is checked to
        // hold the data its header announces, so this is at most the file's size.
        let n = view.data().len() / 2;
        let _ = read_f32(&name, &view, &mut vec![0f32; n]);
        let _ = read_f32(&name, &view, &mut vec![0f32; n / 2]);
    }
});
