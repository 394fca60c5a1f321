//! Runtime flags the engine decides for itself, by GPU generation, instead of an image baking
//! one value for every GPU (docs/flags.md dates each reason).
//!
//! `CUDA_DEVICE_MAX_CONNECTIONS=1` gives the device one hardware work queue, so kernels start in
//! the order they are issued: NCCL's collective, issued on its own stream before the next
//! compute kernel, gets its SMs before that kernel takes them all, and the two overlap as
//! scheduled. NVIDIA's JAX-Toolbox sets it on Hopper (sm_90) only since its #1236/#1249
//! (2025-01-14); on other generations the driver's default is kept. It must be in the
//! environment before the CUDA context exists (a change after it has no effect), so [`apply`]
//! runs between `cuInit` (needed to read the capability) and the engine's context, and never
//! overrides a value the user (or a launcher) set.
//!
//! `NCCL_NVLS_ENABLE` is no longer set anywhere: NCCL's default (NVLink SHARP where an NVSwitch
//! supports it) applies, as in JAX-Toolbox since its #1708 (2025-10-03).

use std::sync::OnceLock;

/// The hardware work queues per device.
pub const MAX_CONNECTIONS: &str = "CUDA_DEVICE_MAX_CONNECTIONS";
/// NVLink SHARP in NCCL.
pub const NVLS_ENABLE: &str = "NCCL_NVLS_ENABLE";

/// Whether a flag is in force, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Set before the engine started (by the user, a launcher or an image): left alone.
    User(String),
    /// The engine sets it.
    Engine {
        /// The value set.
        value: &'static str,
        /// Why, for this device.
        why: String,
    },
    /// Left unset: the library's default applies.
    Unset {
        /// Why.
        why: String,
    },
}

impl std::fmt::Display for Decision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Decision::User(v) => write!(f, "{v}: set by the user, left as it is"),
            Decision::Engine { value, why } => write!(f, "{value}: set by the engine {why}"),
            Decision::Unset { why } => write!(f, "not set: {why}"),
        }
    }
}

/// The `CUDA_DEVICE_MAX_CONNECTIONS` decision for a device of compute capability `capability`
/// (`None`: no usable device), given the variable's value when the engine started (an empty
/// value counts as unset, as `docker run -e VAR=` leaves it).
pub fn max_connections(capability: Option<(i32, i32)>, current: Option<&str>) -> Decision {
    if let Some(v) = current.filter(|v| !v.trim().is_empty()) {
        return Decision::User(v.to_string());
    }
    match capability {
        None => Decision::Unset { why: "no CUDA device".into() },
        Some((9, minor)) => Decision::Engine {
            value: "1",
            why: format!(
                "for sm_9{minor} (Hopper): one hardware queue keeps NCCL's collectives in issue order with the \
                 compute kernels they overlap"
            ),
        },
        Some((10, minor)) => Decision::Unset {
            why: format!(
                "sm_10{minor} (Blackwell) keeps the driver's default queues (NVIDIA's images set 1 on Hopper only; \
                 docs/flags.md)"
            ),
        },
        Some((major, minor)) => Decision::Unset {
            why: format!(
                "sm_{major}{minor} keeps the driver's default queues (the engine sets 1 on Hopper, sm_90, only)"
            ),
        },
    }
}

/// The `NCCL_NVLS_ENABLE` decision: the user's value, or NCCL's default.
pub fn nvls(current: Option<&str>) -> Decision {
    match current.filter(|v| !v.trim().is_empty()) {
        Some(v) => Decision::User(v.to_string()),
        None => Decision::Unset {
            why: "NCCL's default, NVLink SHARP on NVSwitch systems that have it (NCCL_NVLS_ENABLE=0 if NCCL's set-up \
                  runs out of device memory)"
                .into(),
        },
    }
}

/// Every flag the engine decides, for a device of `capability`, with the environment as
/// `lookup` reads it: what `engine info` prints.
pub fn decisions(
    capability: Option<(i32, i32)>,
    lookup: impl Fn(&str) -> Option<String>,
) -> Vec<(&'static str, Decision)> {
    vec![
        (MAX_CONNECTIONS, max_connections(capability, lookup(MAX_CONNECTIONS).as_deref())),
        (NVLS_ENABLE, nvls(lookup(NVLS_ENABLE).as_deref())),
    ]
}

/// Decides the flags for the first device this process opens and sets what the engine sets,
/// once per process; called before the CUDA context is created. Returns the decision taken (the first one, on later calls).
pub fn apply(capability: (i32, i32)) -> &'static Decision {
    static APPLIED: OnceLock<Decision> = OnceLock::new();
    APPLIED.get_or_init(|| {
        let decision = max_connections(Some(capability), std::env::var(MAX_CONNECTIONS).ok().as_deref());
        if let Decision::Engine { value, .. } = &decision {
            // SAFETY: runs once, before the process's first CUDA context, while nothing else
            // reads or writes the environment: the engine reads it on its main thread at start
            // (config, ENGINE_* flags) and NCCL reads it only after the context exists.
            unsafe { std::env::set_var(MAX_CONNECTIONS, value) };
        }
        decision
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hopper_gets_one_queue_unless_the_user_chose() {
        assert!(matches!(max_connections(Some((9, 0)), None), Decision::Engine { value: "1", .. }));
        assert!(matches!(max_connections(Some((9, 0)), Some("")), Decision::Engine { value: "1", .. }));
        assert_eq!(max_connections(Some((9, 0)), Some("8")), Decision::User("8".into()));
        assert_eq!(max_connections(Some((10, 0)), Some("1")), Decision::User("1".into()));
        assert_eq!(max_connections(None, Some("32")), Decision::User("32".into()));
    }

    #[test]
    fn other_generations_keep_the_drivers_default() {
        for cap in [(8, 0), (8, 6), (8, 9), (10, 0), (10, 3), (12, 0)] {
            let d = max_connections(Some(cap), None);
            let Decision::Unset { why } = &d else { panic!("sm_{}{}: {d:?}", cap.0, cap.1) };
            assert!(why.contains(&format!("sm_{}{}", cap.0, cap.1)), "{why}");
        }
        assert_eq!(max_connections(None, None), Decision::Unset { why: "no CUDA device".into() });
        assert!(max_connections(Some((10, 0)), None).to_string().contains("Blackwell"));
    }

    #[test]
    fn nvls_follows_nccl_unless_set() {
        assert_eq!(nvls(Some("0")), Decision::User("0".into()));
        assert!(matches!(nvls(None), Decision::Unset { .. }));
        let env = |k: &str| (k == NVLS_ENABLE).then(|| "1".to_string());
        let all = decisions(Some((9, 0)), env);
        assert_eq!(all[0].0, MAX_CONNECTIONS);
        assert_eq!(all[0].1.to_string().split(':').next(), Some("1"));
        assert!(all[0].1.to_string().contains("set by the engine for sm_90"));
        assert_eq!(all[1], (NVLS_ENABLE, Decision::User("1".into())));
    }
}
