//! Platforms (`linux/amd64`, `linux/arm64`) and how each maps to a Rust target.
use anyhow::Result;
use serde_json::{Value, json};
use std::fmt;

use crate::error::bad_input;

/// An OCI platform this tool can build for.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Platform {
    /// Operating system: always `linux` for the images this tool builds.
    pub os: String,
    /// OCI architecture name: `amd64` or `arm64`.
    pub architecture: String,
    /// `v8` for arm64 (always written, in index and config alike); none for amd64.
    pub variant: Option<String>,
}

impl Platform {
    /// Parses `linux/amd64`, `linux/arm64` or `linux/arm64/v8`.
    pub fn parse(s: &str) -> Result<Platform> {
        let parts: Vec<&str> = s.split('/').collect();
        let p = match parts.as_slice() {
            ["linux", "amd64"] => Platform { os: "linux".into(), architecture: "amd64".into(), variant: None },
            ["linux", "arm64"] | ["linux", "arm64", "v8"] => {
                Platform { os: "linux".into(), architecture: "arm64".into(), variant: Some("v8".into()) }
            }
            _ => {
                return Err(bad_input(format!("platform {s:?} is not supported (use linux/amd64 or linux/arm64)")));
            }
        };
        Ok(p)
    }

    /// The platform of the machine we run on, when it is one we support.
    pub fn host() -> Option<Platform> {
        match std::env::consts::ARCH {
            "x86_64" => Platform::parse("linux/amd64").ok(),
            "aarch64" => Platform::parse("linux/arm64").ok(),
            _ => None,
        }
    }

    /// The Rust target triple the engine is compiled for.
    pub fn rust_target(&self) -> &'static str {
        match self.architecture.as_str() {
            "amd64" => "x86_64-unknown-linux-gnu",
            _ => "aarch64-unknown-linux-gnu",
        }
    }

    /// The cross linker to use when this platform is not the host's (Debian's cross gcc).
    pub fn cross_linker(&self) -> &'static str {
        match self.architecture.as_str() {
            "amd64" => "x86_64-linux-gnu-gcc",
            _ => "aarch64-linux-gnu-gcc",
        }
    }

    /// The `platform` object of an index entry.
    pub fn to_json(&self) -> Value {
        let mut v = json!({"os": self.os, "architecture": self.architecture});
        if let Some(var) = &self.variant {
            v["variant"] = json!(var);
        }
        v
    }

    /// Whether an index entry's `platform` object is this platform (a missing arm64 variant
    /// counts as v8, which is what such images mean).
    pub fn matches(&self, platform: &Value) -> bool {
        let os = platform.get("os").and_then(Value::as_str);
        let arch = platform.get("architecture").and_then(Value::as_str);
        let variant = platform.get("variant").and_then(Value::as_str);
        if os != Some(self.os.as_str()) || arch != Some(self.architecture.as_str()) {
            return false;
        }
        match (self.architecture.as_str(), variant) {
            ("arm64", None | Some("v8")) => true,
            (_, v) => v == self.variant.as_deref(),
        }
    }

    /// `linux-amd64`, for file names.
    pub fn slug(&self) -> String {
        format!("{}-{}", self.os, self.architecture)
    }
}

impl fmt::Display for Platform {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_match() {
        let arm = Platform::parse("linux/arm64").unwrap();
        assert_eq!(arm, Platform::parse("linux/arm64/v8").unwrap());
        assert_eq!(arm.to_json(), json!({"os":"linux","architecture":"arm64","variant":"v8"}));
        assert!(arm.matches(&json!({"os":"linux","architecture":"arm64"})));
        assert!(!arm.matches(&json!({"os":"linux","architecture":"arm64","variant":"v9"})));
        let amd = Platform::parse("linux/amd64").unwrap();
        assert_eq!(amd.rust_target(), "x86_64-unknown-linux-gnu");
        assert!(amd.matches(&json!({"os":"linux","architecture":"amd64"})));
        assert!(!amd.matches(&json!({"os":"windows","architecture":"amd64"})));
        assert!(Platform::parse("linux/riscv64").is_err());
        assert!(Platform::parse("amd64").is_err());
    }
}
