//! The sources manifest parser (`images/manifest.toml`: upstream pins, tracking refs, patches),
//! whose errors name `file:line:column`. Anything may be refused; no input may panic.
#![no_main]

use distro::sources::Manifest;
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = Manifest::parse(Path::new("images/manifest.toml"), &text);
});
