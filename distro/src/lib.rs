//! The distribution tool: pins upstream sources plus cherry-picked patches and builds
//! reproducible, dated, multi-arch OCI images of the engine.
