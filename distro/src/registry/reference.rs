//! Image references: `[registry/]repository[:tag][@sha256:digest]`, with Docker Hub's defaults.
use crate::error::bad_input;
use crate::oci::digest::Digest;
use anyhow::Result;
use std::fmt;

/// A parsed image reference.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reference {
    /// Registry as written (`docker.io` for Docker Hub), with port if any.
    pub registry: String,
    /// Repository path (`library/debian` on Docker Hub).
    pub repository: String,
    /// Tag, if any.
    pub tag: Option<String>,
    /// Digest, if any (wins over the tag when pulling).
    pub digest: Option<Digest>,
}

impl Reference {
    /// Parses a reference; a bare name means Docker Hub, as with `docker pull`.
    pub fn parse(s: &str) -> Result<Reference> {
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => (r, Some(Digest::parse(d).map_err(|e| bad_input(format!("reference {s:?}: {e}")))?)),
            None => (s, None),
        };
        let last_slash = rest.rfind('/').map(|i| i + 1).unwrap_or(0);
        let (name, tag) = match rest[last_slash..].rfind(':') {
            Some(i) => (&rest[..last_slash + i], Some(rest[last_slash + i + 1..].to_string())),
            None => (rest, None),
        };
        let (registry, repository) = match name.split_once('/') {
            Some((first, path)) if first.contains('.') || first.contains(':') || first == "localhost" => {
                (first.to_string(), path.to_string())
            }
            _ => ("docker.io".to_string(), name.to_string()),
        };
        let repository = if registry == "docker.io" && !repository.contains('/') {
            format!("library/{repository}")
        } else {
            repository
        };
        let valid_component = |c: &str| {
            !c.is_empty()
                && c.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
                && c.as_bytes()[0].is_ascii_alphanumeric()
        };
        if repository.split('/').any(|c| !valid_component(c)) {
            return Err(bad_input(format!("reference {s:?}: repository {repository:?} is not valid")));
        }
        if registry.is_empty() || registry.contains(|c: char| c.is_whitespace() || c == '/') {
            return Err(bad_input(format!("reference {s:?}: registry {registry:?} is not valid")));
        }
        if let Some(t) = &tag {
            let ok = !t.is_empty()
                && t.len() <= 128
                && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b))
                && !t.starts_with(['.', '-']);
            if !ok {
                return Err(bad_input(format!("reference {s:?}: tag {t:?} is not valid")));
            }
        }
        Ok(Reference { registry, repository, tag, digest })
    }

    /// The host the API lives on (Docker Hub's API is not on `docker.io`).
    pub fn api_host(&self) -> &str {
        if self.registry == "docker.io" { "registry-1.docker.io" } else { &self.registry }
    }

    /// What to ask the registry for: the digest if known, else the tag, else `latest`.
    pub fn manifest_ref(&self) -> String {
        match (&self.digest, &self.tag) {
            (Some(d), _) => d.to_string(),
            (None, Some(t)) => t.clone(),
            (None, None) => "latest".to_string(),
        }
    }

    /// `registry/repository`, without tag or digest.
    pub fn name(&self) -> String {
        format!("{}/{}", self.registry, self.repository)
    }

    /// The same repository with another tag and no digest.
    pub fn with_tag(&self, tag: &str) -> Reference {
        Reference { tag: Some(tag.to_string()), digest: None, ..self.clone() }
    }

    /// The same repository at a digest.
    pub fn with_digest(&self, digest: &Digest) -> Reference {
        Reference { tag: None, digest: Some(digest.clone()), ..self.clone() }
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const D: &str = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn forms() {
        let r = Reference::parse("debian").unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.tag.as_deref()),
            ("docker.io", "library/debian", None)
        );
        assert_eq!(r.api_host(), "registry-1.docker.io");
        assert_eq!(r.manifest_ref(), "latest");
        let r = Reference::parse("localhost:5000/base/debian:bookworm").unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.tag.as_deref()),
            ("localhost:5000", "base/debian", Some("bookworm"))
        );
        let r = Reference::parse(&format!("nvcr.io/nvidia/cuda:13.0.3-cudnn-runtime-ubuntu24.04@{D}")).unwrap();
        assert_eq!(r.repository, "nvidia/cuda");
        assert_eq!(r.manifest_ref(), D);
        assert_eq!(r.to_string(), format!("nvcr.io/nvidia/cuda:13.0.3-cudnn-runtime-ubuntu24.04@{D}"));
        let r = Reference::parse("ghcr.io/org/distro").unwrap();
        assert_eq!(r.with_tag("engine").to_string(), "ghcr.io/org/distro:engine");
        let r = Reference::parse("127.0.0.1:5001/x").unwrap();
        assert_eq!(r.registry, "127.0.0.1:5001");
    }

    #[test]
    fn bad_ones() {
        for s in ["", "UPPER/case", "host/repo:bad tag", "x@sha256:123", "host//repo", "a/-b"] {
            assert!(Reference::parse(s).is_err(), "{s}");
        }
    }
}
