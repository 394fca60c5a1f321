//! The Arrow IPC reader (`engine data prepare` on `.arrow` files: Hugging Face's cache files and
//! IPC files): `data::arrow_ipc::read_column`, the function the reader calls, streaming the
//! `text` column of the input, every row's text taken as the reader takes it. Anything may be
//! refused; no input may panic, hang, overflow the stack or allocate without bound.
#![no_main]

use engine::data::arrow_ipc::read_column;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut bytes = 0usize;
    let _ = read_column(&mut &data[..], "text", &mut |_, text| {
        bytes += text.len();
        Ok(())
    });
});
