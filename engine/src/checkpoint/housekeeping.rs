//! The checkpoints directory: naming a step's directory, listing the complete ones, and clearing
//! what interrupted saves and superseded runs leave, or what `keep_last` no longer keeps.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::Checkpoint;
use crate::fsutil;

/// The name of the directory of step `step`.
pub fn dir_name(step: u64) -> String {
    format!("step-{step:06}")
}

/// Removes `parent/.tmp-NAME-PID` directories that [`super::write_dir`] left when killed: those of
/// processes that no longer run (an import into `NAME` running now keeps its own).
pub(super) fn remove_stale_temporaries_of(parent: &Path, name: &str) -> Result<()> {
    let Ok(entries) = fs::read_dir(parent) else { return Ok(()) };
    let prefix = format!(".tmp-{name}-");
    for entry in entries.filter_map(|e| e.ok()) {
        let file_name = entry.file_name();
        let Some(pid) = file_name.to_str().and_then(|n| n.strip_prefix(&prefix)).and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        if !fsutil::process_alive(pid) {
            let path = entry.path();
            let removed = if path.is_dir() { fs::remove_dir_all(&path) } else { fs::remove_file(&path) };
            removed.with_context(|| format!("cannot remove {}, left by a killed process", entry.path().display()))?;
        }
    }
    Ok(())
}

/// The complete checkpoints under `parent` (directories named `step-N`), oldest first.
/// Temporary directories of saves that did not finish are not listed.
pub fn list(parent: &Path) -> Result<Vec<(u64, PathBuf)>> {
    if !parent.exists() {
        return Ok(Vec::new());
    }
    let mut out: Vec<(u64, PathBuf)> = fs::read_dir(parent)
        .with_context(|| format!("cannot list {}", parent.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step = name.strip_prefix("step-")?.parse().ok()?;
            e.path().is_dir().then(|| (step, e.path()))
        })
        .collect();
    out.sort();
    Ok(out)
}

/// Removes what interrupted saves left under `parent` (`.tmp-*` directories); returns them.
pub fn remove_temporaries(parent: &Path) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    if !parent.exists() {
        return Ok(removed);
    }
    for e in fs::read_dir(parent)?.filter_map(|e| e.ok()) {
        if e.file_name().to_string_lossy().starts_with(".tmp-") {
            fs::remove_dir_all(e.path()).with_context(|| format!("cannot remove {}", e.path().display()))?;
            removed.push(e.path());
        }
    }
    Ok(removed)
}

/// Renames the complete checkpoints newer than `step` to `superseded-step-N` (a run resumed
/// from `step` replaces what followed it; they are kept for the user to inspect or remove, but
/// no longer count as checkpoints). Returns their new paths.
pub fn set_aside_after(parent: &Path, step: u64) -> Result<Vec<PathBuf>> {
    let mut moved = Vec::new();
    for (s, dir) in list(parent)?.into_iter().filter(|(s, _)| *s > step) {
        let to = parent.join(format!("superseded-{}-{}", dir_name(s), std::process::id()));
        fs::rename(&dir, &to).with_context(|| format!("cannot move {} aside", dir.display()))?;
        moved.push(to);
    }
    if !moved.is_empty() {
        fsutil::sync_dir(parent)?;
    }
    Ok(moved)
}

/// Removes the oldest complete checkpoints beyond the newest `keep_last` (0 keeps all), except
/// the steps that are multiples of `keep_every` (0: none), which are kept for good. Each is
/// renamed away first, so a half-removed directory never looks like a checkpoint.
pub fn prune(parent: &Path, keep_last: usize, keep_every: usize) -> Result<()> {
    let all = list(parent)?;
    if keep_last == 0 || all.len() <= keep_last {
        return Ok(());
    }
    let permanent = |step: u64| keep_every > 0 && step.is_multiple_of(keep_every as u64);
    let doomed: Vec<_> = all[..all.len() - keep_last].iter().filter(|(step, _)| !permanent(*step)).collect();
    for (step, dir) in &doomed {
        let away = parent.join(format!(".tmp-removing-{}", dir_name(*step)));
        fs::rename(dir, &away).with_context(|| format!("cannot remove {}", dir.display()))?;
        fs::remove_dir_all(&away).with_context(|| format!("cannot remove {}", away.display()))?;
    }
    if !doomed.is_empty() {
        fsutil::sync_dir(parent)?;
    }
    Ok(())
}

/// The newest complete checkpoint under `parent`, verified. A damaged newest checkpoint is an
/// error (naming the file and the previous checkpoint), never skipped silently.
pub fn latest(parent: &Path) -> Result<Option<Checkpoint>> {
    let all = list(parent)?;
    let Some((_, newest)) = all.last() else { return Ok(None) };
    Checkpoint::open(newest).map(Some).map_err(|e| match all.len() {
        1 => e,
        n => e.context(format!(
            "the previous checkpoint is {}; resume from it with --resume {} after checking the damage",
            all[n - 2].1.display(),
            all[n - 2].1.display()
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::testing::{small, snapshot};
    use crate::checkpoint::{Extras, MODEL_FILE, write, write_dir};

    #[test]
    fn the_newest_complete_checkpoint_is_found_and_old_ones_pruned() {
        let dir = tempfile::tempdir().unwrap();
        let config = small();
        let (layout, mut snap) = snapshot(&config, 0);
        for step in [1, 2, 4, 6] {
            snap.step = step;
            write(dir.path(), &config, &layout, &snap, &Extras::default(), None).unwrap();
        }
        // What a save killed in the middle leaves: ignored, then removed.
        fs::create_dir(dir.path().join(".tmp-step-000008-99")).unwrap();
        let steps = |dir: &Path| list(dir).unwrap().iter().map(|(s, _)| *s).collect::<Vec<_>>();
        assert_eq!(steps(dir.path()), [1, 2, 4, 6]);
        assert_eq!(latest(dir.path()).unwrap().unwrap().state.step, 6);
        assert_eq!(remove_temporaries(dir.path()).unwrap().len(), 1);
        // keep_every_n_steps = 2 keeps step 2 for good; keep_last = 2 keeps 4 and 6.
        prune(dir.path(), 2, 2).unwrap();
        assert_eq!(steps(dir.path()), [2, 4, 6]);
        prune(dir.path(), 2, 0).unwrap();
        assert_eq!(steps(dir.path()), [4, 6]);
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 2);
        // A damaged newest checkpoint is an error that points at the previous one.
        fs::remove_file(dir.path().join("step-000006").join(MODEL_FILE)).unwrap();
        let e = format!("{:#}", latest(dir.path()).unwrap_err());
        assert!(e.contains("model.safetensors is missing") && e.contains("step-000004"), "{e}");
    }

    #[test]
    fn temporaries_of_killed_imports_are_removed_by_the_next() {
        let config = small();
        let (layout, snap) = snapshot(&config, 0);
        let dir = tempfile::tempdir().unwrap();
        // PID 2^22 + 1 is above Linux's pid_max: no such process can exist.
        let dead = dir.path().join(".tmp-ck-4194305");
        let live = dir.path().join(".tmp-ck-1"); // init
        let other = dir.path().join(".tmp-ck-2-4194305");
        for d in [&dead, &live, &other] {
            fs::create_dir_all(d.join("part")).unwrap();
        }
        write_dir(&dir.path().join("ck"), &config, &layout, &snap, &Extras::default(), None).unwrap();
        assert!(!dead.exists() && live.exists() && other.exists());
        write_dir(&dir.path().join("ck-2"), &config, &layout, &snap, &Extras::default(), None).unwrap();
        assert!(!other.exists());
    }
}
