//! The OCI manifest parsers: a manifest or index from a registry or a store (its media type,
//! an index's entry for a platform, an image manifest's config and layers, Docker types
//! translated), and a layout's `index.json` and manifests as `distro push` and `load` walk them.
//! Anything may be refused; no input may panic, hang or overflow.
#![no_main]

use distro::oci::layout::Layout;
use distro::oci::manifest::{Descriptor, ImageParts, OCI_MANIFEST, index_entry, media_type_of};
use distro::oci::platform::Platform;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = media_type_of(data);
    let _ = ImageParts::parse(data);
    for p in ["linux/amd64", "linux/arm64"] {
        let _ = index_entry(data, &Platform::parse(p).unwrap());
    }

    // The same bytes as a layout's index.json, and as a manifest blob in it.
    let dir = std::env::temp_dir().join(format!("fuzz-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    std::fs::write(dir.join("index.json"), data).unwrap();
    let layout = Layout::open(&dir).unwrap();
    if let Ok(refs) = layout.refs() {
        for (_, d) in refs {
            let _ = layout.reachable(&d);
        }
    }
    let blob = layout.store.put(data).unwrap();
    let _ = layout.reachable(&Descriptor::of(OCI_MANIFEST, data));
    std::fs::remove_file(layout.store.path(&blob)).unwrap();
});
