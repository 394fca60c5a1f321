//! The `WWW-Authenticate` parser (a registry's challenge, attacker-controlled): the challenges
//! and the scopes of a Bearer challenge's `scope` parameter. No input may panic or hang.
#![no_main]

use distro::registry::auth::{Scope, parse_challenges};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let header = String::from_utf8_lossy(data);
    for challenge in parse_challenges(&header) {
        assert_eq!(challenge.scheme, challenge.scheme.to_ascii_lowercase());
        if let Some(scope) = challenge.params.get("scope") {
            let _ = Scope::merge(Scope::parse_list(scope));
        }
    }
});
