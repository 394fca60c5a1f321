//! Docker.
