//! The training engine.
