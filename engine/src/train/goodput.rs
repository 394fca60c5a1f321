//! Goodput: how much of a run's wall time trained the model, and where the rest went.
//!
//! Every run directory keeps a timeline of all its attempts (the first start, restarts,
//! requeues) in `RUN_DIR/goodput.jsonl`, one JSON record a line, appended and never rewritten:
//!
//! ```text
//! {"kind":"start","attempt":2,"t":…,"ready_t":…,"resumed_after_step":40,"rendezvous_s":…,"checkpoint_load_s":…,"device_setup_s":…}
//! {"kind":"step","attempt":2,"step":41,"t":…,"step_s":…,"data_s":…,"sync_s":…,"eval_s":…,"checkpoint_s":…}
//! {"kind":"end","attempt":2,"t":…,"outcome":"completed"}
//! ```
//!
//! `t` is the wall clock (Unix seconds) when the record was written; a start record's `t` is
//! when the process started, `ready_t` when its first step began. Each record is one `write`
//! to a file opened for appending, so that a killed process leaves whole lines: an attempt
//! killed with SIGKILL has no `end`, and its last record is the last step it logged (what the
//! kernel has of a file outlives the process; only a crash of the machine loses the tail).
//!
//! [`Report::of`] reads a timeline into wall time by cause, for each attempt, the last one and
//! the whole run (as MaxText's ml-goodput-measurement names them):
//!
//! ```text
//! wall        = from the process's start to its last record (end, or last step when killed)
//! start-up    = process start → first step: rendezvous + checkpoint load + device set-up + other
//! productive  = Σ (step_s − data_s) over steps no earlier attempt had logged
//! recomputed  = Σ step_s over steps an earlier attempt had logged (wasted progress)
//! data waits  = Σ data_s over the others;   checkpoint stalls = Σ checkpoint_s
//! evaluation  = Σ eval_s;                   step sync = Σ sync_s (the step boundary's exchange)
//! unaccounted = wall − all of the above (logging, the summary, …)
//! goodput     = productive ÷ wall
//! ```
//!
//! The whole run's wall is the sum of its attempts' walls plus the time between them (a
//! requeue's wait), which is a cause of its own (`idle_between_attempts`).

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

/// The timeline's file in the run directory.
pub const GOODPUT: &str = "goodput.jsonl";

/// How long this attempt took to start, by part, measured by the command that starts it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Startup {
    /// Joining the job: the rendezvous and the communicator's set-up (0 for one process).
    pub rendezvous_s: f64,
    /// Finding, verifying and reading the checkpoint the run resumes (0 for a fresh start).
    pub checkpoint_load_s: f64,
    /// Opening the device (CUDA context, NVRTC kernels, the peak measurement) and allocating
    /// the model's buffers.
    pub device_setup_s: f64,
}

/// One line of the timeline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    /// An attempt began: `t` is its process's start, `ready_t` the start of its first step.
    Start {
        /// 1 for the run's first attempt, then one more per restart.
        attempt: u32,
        /// When the process started (Unix seconds).
        t: f64,
        /// When the step loop began.
        ready_t: f64,
        /// The step the attempt continues after (0: from the start).
        resumed_after_step: u64,
        /// The measured parts of its start-up.
        #[serde(flatten)]
        startup: Startup,
    },
    /// A step, written once its checkpoint stall and evaluation are known.
    Step {
        /// The attempt that ran it.
        attempt: u32,
        /// The step's number.
        step: u64,
        /// When the record was written.
        t: f64,
        /// The step's time (forward, backward, collectives, optimizer), data waits included.
        step_s: f64,
        /// Of that, the time spent waiting for the batch.
        data_s: f64,
        /// The step boundary's exchange between the devices (the stop flag, the slowest rank).
        sync_s: f64,
        /// Evaluation after the step.
        eval_s: f64,
        /// The step loop's stall for a checkpoint after the step.
        checkpoint_s: f64,
        /// Recording the step: `metrics.jsonl`, TensorBoard, the printed line.
        #[serde(default)]
        logging_s: f64,
    },
    /// An attempt ended on its own: `completed`, `stopped` (a signal, with a checkpoint),
    /// `diverged`, or `failed` (an error ended the step loop: a lost peer, a full disk).
    End {
        /// The attempt.
        attempt: u32,
        /// When it ended.
        t: f64,
        /// How.
        outcome: String,
        /// The wait for the last checkpoint's write to finish.
        #[serde(default)]
        checkpoint_s: f64,
    },
}

/// Seconds since the Unix epoch, now.
pub fn now() -> f64 {
    unix(SystemTime::now())
}

fn unix(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// When this process started, on the wall clock: from `/proc` on Linux (to the clock tick),
/// else the first call of this function (which `main` makes first thing).
pub fn process_start() -> f64 {
    static FIRST_CALL: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    let first = *FIRST_CALL.get_or_init(now);
    proc_start().unwrap_or(first)
}

/// The process's start from `/proc/self/stat` (clock ticks after boot), against the boot-time
/// clock now: `/proc/stat`'s boot time is rounded to the second, and drifts from the wall clock.
fn proc_start() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces.
    let after = &stat[stat.rfind(')')? + 2..];
    let ticks: f64 = after.split(' ').nth(19)?.parse().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let mut boot = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we own.
    let read = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut boot) };
    if hz <= 0 || read != 0 {
        return None;
    }
    let running = boot.tv_sec as f64 + boot.tv_nsec as f64 * 1e-9 - ticks / hz as f64;
    Some(now() - running.max(0.0))
}

/// Times a part of the start-up: `f`'s result and its seconds.
pub fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let start = Instant::now();
    let out = f();
    (out, start.elapsed().as_secs_f64())
}

/// The lead's handle on the timeline: appends this attempt's records. Dropped without an end
/// (an error left the step loop: a full disk), it records the attempt `failed`.
pub struct Timeline {
    file: File,
    attempt: u32,
    ended: bool,
}

impl Timeline {
    /// Opens `RUN_DIR/goodput.jsonl` for appending and records this attempt's start: the number
    /// after the attempts it holds, the process's start, the step it continues after.
    pub fn begin(run_dir: &Path, resumed_after_step: u64, startup: Startup) -> Result<Timeline> {
        let path = run_dir.join(GOODPUT);
        let earlier = read(&path)?.iter().filter(|r| matches!(r, Record::Start { .. })).count();
        let file = File::options()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {} for appending", path.display()))?;
        let mut timeline = Timeline { file, attempt: earlier as u32 + 1, ended: false };
        let t = process_start();
        timeline.append(&Record::Start {
            attempt: timeline.attempt,
            t,
            ready_t: now().max(t),
            resumed_after_step,
            startup,
        })?;
        Ok(timeline)
    }

    /// This attempt's number.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Records a step's times (a [`Record::Step`] whose `attempt` and `t` are filled in here).
    pub fn step(&mut self, mut record: Record) -> Result<()> {
        if let Record::Step { attempt, t, .. } = &mut record {
            (*attempt, *t) = (self.attempt, now());
        }
        self.append(&record)
    }

    /// Records the attempt's end, after `checkpoint_s` waiting for the last save.
    pub fn end(&mut self, outcome: &str, checkpoint_s: f64) -> Result<()> {
        self.ended = true;
        self.append(&Record::End { attempt: self.attempt, t: now(), outcome: outcome.into(), checkpoint_s })
    }

    /// One record, one `write` of a whole line to a file opened for appending.
    fn append(&mut self, record: &Record) -> Result<()> {
        let mut line = serde_json::to_vec(record)?;
        line.push(b'\n');
        self.file.write_all(&line).context("cannot append to the goodput timeline")
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        if !self.ended {
            // Best effort: the error that ends the attempt is the one to report.
            let _ = self.end("failed", 0.0);
        }
    }
}

/// The records of a timeline; none when the file does not exist. A line that does not read
/// (a tail cut by a crash of the machine) is left out.
///
/// Bounded whatever the file: a line longer than [`MAX_LINE`] is refused, naming the file and
/// the line, and so is a record whose times are not plausible ([`Record::check`]): negative,
/// not finite, or past [`MAX_SECONDS`].
pub fn read(path: &Path) -> Result<Vec<Record>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let mut records = Vec::new();
    crate::fsutil::for_each_line(path, MAX_LINE, |n, line| {
        if let Ok(record) = serde_json::from_str::<Record>(line) {
            record.check().map_err(|e| anyhow::anyhow!("{}:{n}: {e}", path.display()))?;
            records.push(record);
        }
        Ok(())
    })?;
    Ok(records)
}

/// The longest line of a timeline: its records are a few hundred bytes.
pub const MAX_LINE: usize = 64 << 10;

/// The latest time and the longest duration a record may hold, in seconds (the year 5138).
pub const MAX_SECONDS: f64 = 1e11;

impl Record {
    /// Refuses times that no run writes: negative, not finite, or past [`MAX_SECONDS`].
    fn check(&self) -> Result<()> {
        let times: Vec<(&str, f64)> = match self {
            Record::Start { t, ready_t, startup, .. } => vec![
                ("t", *t),
                ("ready_t", *ready_t),
                ("rendezvous_s", startup.rendezvous_s),
                ("checkpoint_load_s", startup.checkpoint_load_s),
                ("device_setup_s", startup.device_setup_s),
            ],
            Record::Step { t, step_s, data_s, sync_s, eval_s, checkpoint_s, logging_s, .. } => vec![
                ("t", *t),
                ("step_s", *step_s),
                ("data_s", *data_s),
                ("sync_s", *sync_s),
                ("eval_s", *eval_s),
                ("checkpoint_s", *checkpoint_s),
                ("logging_s", *logging_s),
            ],
            Record::End { t, checkpoint_s, .. } => vec![("t", *t), ("checkpoint_s", *checkpoint_s)],
        };
        for (name, value) in times {
            if !(0.0..=MAX_SECONDS).contains(&value) {
                let value = if value.abs() < 1e15 { value.to_string() } else { format!("{value:e}") };
                bail!(
                    "{name} = {value}: a time in seconds is between 0 and {MAX_SECONDS:e}; not a timeline this engine wrote"
                );
            }
        }
        Ok(())
    }
}

/// Wall time by cause, in seconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Figures {
    /// From the (first) process start to the last record.
    pub wall_s: f64,
    /// Steps that advanced the run, less their data waits.
    pub productive_s: f64,
    /// `productive_s / wall_s`.
    pub goodput: f64,
    /// The rest of the wall time, by cause.
    pub badput: Badput,
    /// Steps run, and of them those run again after a restart.
    pub steps: u64,
    /// Steps an earlier attempt had already logged (wasted progress).
    pub recomputed_steps: u64,
}

/// The wall time that did not train, by cause.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Badput {
    /// Start-up: joining the job.
    pub startup_rendezvous_s: f64,
    /// Start-up: finding, verifying and reading the checkpoint.
    pub startup_checkpoint_load_s: f64,
    /// Start-up: the device and the model's buffers.
    pub startup_device_s: f64,
    /// Start-up: the rest (the process, the recipe, the data, the run directory).
    pub startup_other_s: f64,
    /// The step loop's stalls for checkpoints.
    pub checkpoint_s: f64,
    /// Evaluation.
    pub eval_s: f64,
    /// Waiting for batches.
    pub data_s: f64,
    /// The step boundary's exchange between the devices.
    pub sync_s: f64,
    /// Recording each step (`metrics.jsonl`, TensorBoard, the printed line).
    pub logging_s: f64,
    /// Steps computed again after a restart (wasted progress).
    pub recomputed_s: f64,
    /// Between one attempt's last record and the next one's start (the whole run only).
    pub idle_between_attempts_s: f64,
    /// What no cause explains (logging, the summary, a killed attempt's last partial step).
    pub unaccounted_s: f64,
}

impl Badput {
    /// The causes with their labels, in the table's order (the unaccounted rest last).
    pub fn causes(&self) -> [(&'static str, f64); 12] {
        [
            ("start-up: rendezvous", self.startup_rendezvous_s),
            ("start-up: checkpoint load", self.startup_checkpoint_load_s),
            ("start-up: device set-up", self.startup_device_s),
            ("start-up: other", self.startup_other_s),
            ("checkpoint stalls", self.checkpoint_s),
            ("evaluation", self.eval_s),
            ("data waits", self.data_s),
            ("step sync", self.sync_s),
            ("logging", self.logging_s),
            ("recomputed steps", self.recomputed_s),
            ("idle between attempts", self.idle_between_attempts_s),
            ("unaccounted", self.unaccounted_s),
        ]
    }

    fn add(&mut self, o: &Badput) {
        self.startup_rendezvous_s += o.startup_rendezvous_s;
        self.startup_checkpoint_load_s += o.startup_checkpoint_load_s;
        self.startup_device_s += o.startup_device_s;
        self.startup_other_s += o.startup_other_s;
        self.checkpoint_s += o.checkpoint_s;
        self.eval_s += o.eval_s;
        self.data_s += o.data_s;
        self.sync_s += o.sync_s;
        self.logging_s += o.logging_s;
        self.recomputed_s += o.recomputed_s;
        self.idle_between_attempts_s += o.idle_between_attempts_s;
        self.unaccounted_s += o.unaccounted_s;
    }
}

/// One attempt's figures.
#[derive(Debug, Clone, Serialize)]
pub struct Attempt {
    /// Its number.
    pub attempt: u32,
    /// When its process started (Unix seconds).
    pub started: f64,
    /// The step it continued after.
    pub resumed_after_step: u64,
    /// `completed`, `stopped`, `diverged`, `failed` (an error: a lost peer, a full disk), or
    /// `killed` (no end record: it ended after its last record, killed, lost with its node, or
    /// ended at once by the collectives' watchdog when a peer was lost, exit 75).
    pub outcome: String,
    /// Its last logged step.
    pub last_step: u64,
    /// Its time by cause.
    #[serde(flatten)]
    pub figures: Figures,
}

/// A timeline read into figures.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Every attempt, in order.
    pub attempts: Vec<Attempt>,
    /// The last attempt's figures.
    pub last_attempt: Figures,
    /// The whole run's: every attempt and the time between them.
    pub run: Figures,
}

/// What `summary.json` holds of a report: the last attempt and the whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The attempts so far, this one included.
    pub attempts: usize,
    /// This attempt's figures.
    pub last_attempt: Figures,
    /// The whole run's.
    pub run: Figures,
}

impl Report {
    /// The figures of a timeline's records (in file order). Records before the first start,
    /// of which there are none unless the file was edited, are left out.
    pub fn of(records: &[Record]) -> Option<Report> {
        let mut attempts: Vec<Attempt> = Vec::new();
        let mut last_t = Vec::new();
        // The highest step that the attempts before the current one logged.
        let (mut done_before, mut done) = (0u64, 0u64);
        for r in records {
            match r {
                Record::Start { attempt, t, ready_t, resumed_after_step, startup } => {
                    done_before = done_before.max(done);
                    let mut b = Badput {
                        startup_rendezvous_s: startup.rendezvous_s,
                        startup_checkpoint_load_s: startup.checkpoint_load_s,
                        startup_device_s: startup.device_setup_s,
                        ..Badput::default()
                    };
                    let measured = startup.rendezvous_s + startup.checkpoint_load_s + startup.device_setup_s;
                    b.startup_other_s = (ready_t - t - measured).max(0.0);
                    attempts.push(Attempt {
                        attempt: *attempt,
                        started: *t,
                        resumed_after_step: *resumed_after_step,
                        outcome: "killed".into(),
                        last_step: *resumed_after_step,
                        figures: Figures { badput: b, ..Figures::default() },
                    });
                    last_t.push(*ready_t);
                }
                Record::Step { step, t, step_s, data_s, sync_s, eval_s, checkpoint_s, logging_s, .. } => {
                    let Some(a) = attempts.last_mut() else { continue };
                    let f = &mut a.figures;
                    if *step <= done_before {
                        f.badput.recomputed_s += step_s;
                        f.recomputed_steps += 1;
                    } else {
                        f.productive_s += step_s - data_s;
                        f.badput.data_s += data_s;
                    }
                    f.badput.sync_s += sync_s;
                    f.badput.eval_s += eval_s;
                    f.badput.checkpoint_s += checkpoint_s;
                    f.badput.logging_s += logging_s;
                    f.steps += 1;
                    a.last_step = *step;
                    done = done.max(*step);
                    *last_t.last_mut().unwrap() = *t;
                }
                Record::End { t, outcome, checkpoint_s, .. } => {
                    let Some(a) = attempts.last_mut() else { continue };
                    a.outcome = outcome.clone();
                    a.figures.badput.checkpoint_s += checkpoint_s;
                    *last_t.last_mut().unwrap() = *t;
                }
            }
        }
        let last_index = attempts.len().checked_sub(1)?;
        for (a, end) in attempts.iter_mut().zip(&last_t) {
            a.figures.wall_s = (end - a.started).max(0.0);
            finish(&mut a.figures);
        }
        let mut run = Figures::default();
        for (i, a) in attempts.iter().enumerate() {
            run.productive_s += a.figures.productive_s;
            run.steps += a.figures.steps;
            run.recomputed_steps += a.figures.recomputed_steps;
            run.badput.add(&a.figures.badput);
            run.wall_s += a.figures.wall_s;
            if i > 0 {
                run.badput.idle_between_attempts_s += (a.started - last_t[i - 1]).max(0.0);
            }
        }
        run.wall_s += run.badput.idle_between_attempts_s;
        run.goodput = ratio(run.productive_s, run.wall_s);
        let last_attempt = attempts[last_index].figures.clone();
        Some(Report { attempts, last_attempt, run })
    }

    /// The part of `summary.json`.
    pub fn summary(&self) -> Summary {
        Summary { attempts: self.attempts.len(), last_attempt: self.last_attempt.clone(), run: self.run.clone() }
    }

    /// The table `engine goodput` prints.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let row = |out: &mut String, label: &str, a: f64, aw: f64, r: f64, rw: f64| {
            out.push_str(&format!(
                "{label:<26} {a:>10.3} s {:>6.1} %   {r:>10.3} s {:>6.1} %\n",
                100.0 * ratio(a, aw),
                100.0 * ratio(r, rw)
            ));
        };
        let (l, r) = (&self.last_attempt, &self.run);
        out.push_str(&format!("{:<26} {:>21}   {:>21}\n", "", "last attempt", "whole run"));
        row(&mut out, "productive", l.productive_s, l.wall_s, r.productive_s, r.wall_s);
        for ((label, a), (_, b)) in l.badput.causes().iter().zip(r.badput.causes()) {
            row(&mut out, label, *a, l.wall_s, b, r.wall_s);
        }
        row(&mut out, "wall", l.wall_s, l.wall_s, r.wall_s, r.wall_s);
        out.push_str(&format!(
            "goodput {:.1} % of the last attempt, {:.1} % of the run; {} steps run, {} of them recomputed after a restart\n",
            100.0 * l.goodput,
            100.0 * r.goodput,
            r.steps,
            r.recomputed_steps
        ));
        out.push_str("\nattempt  started (UTC)         after step  last step  outcome    wall s  goodput\n");
        for a in &self.attempts {
            out.push_str(&format!(
                "{:>7}  {}  {:>10}  {:>9}  {:<9} {:>7.2}  {:>6.1} %\n",
                a.attempt,
                utc(a.started),
                a.resumed_after_step,
                a.last_step,
                a.outcome,
                a.figures.wall_s,
                100.0 * a.figures.goodput
            ));
        }
        out
    }

    /// The TensorBoard scalars of the report: `goodput/{attempt,run}` and `badput/{attempt,run}/<cause>`
    /// in seconds.
    pub fn scalars(&self) -> Vec<(String, f64)> {
        let mut v = Vec::new();
        for (scope, f) in [("attempt", &self.last_attempt), ("run", &self.run)] {
            v.push((format!("goodput/{scope}"), f.goodput));
            v.push((format!("goodput/{scope}/productive_s"), f.productive_s));
            v.push((format!("goodput/{scope}/wall_s"), f.wall_s));
            for (label, s) in f.badput.causes() {
                v.push((format!("badput/{scope}/{}", label.replace("start-up: ", "startup_").replace(' ', "_")), s));
            }
        }
        v
    }
}

/// The unaccounted rest and the goodput of an attempt whose wall and causes are known.
fn finish(f: &mut Figures) {
    let b = &f.badput;
    let explained: f64 = b.causes()[..11].iter().map(|(_, s)| s).sum::<f64>() + f.productive_s;
    f.badput.unaccounted_s = (f.wall_s - explained).max(0.0);
    f.goodput = ratio(f.productive_s, f.wall_s);
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

/// Unix seconds as `YYYY-MM-DD HH:MM:SS`.
fn utc(t: f64) -> String {
    let secs = t.max(0.0) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(attempt: u32, t: f64, ready: f64, after: u64, load: f64) -> Record {
        let startup = Startup { rendezvous_s: 0.5, checkpoint_load_s: load, device_setup_s: 1.0 };
        Record::Start { attempt, t, ready_t: ready, resumed_after_step: after, startup }
    }

    fn step(attempt: u32, step: u64, t: f64, checkpoint_s: f64) -> Record {
        Record::Step {
            attempt,
            step,
            t,
            step_s: 1.0,
            data_s: 0.25,
            sync_s: 0.0,
            eval_s: 0.0,
            checkpoint_s,
            logging_s: 0.0,
        }
    }

    /// Two attempts: the first saves after step 2 and is killed after step 4; the second starts
    /// 10 s later from step 2, computes 3 and 4 again (wasted progress), then 5, and ends.
    #[test]
    fn a_killed_and_resumed_run_is_split_by_cause() {
        let records = [
            start(1, 100.0, 103.0, 0, 0.0),
            step(1, 1, 104.0, 0.0),
            step(1, 2, 105.5, 0.5),
            step(1, 3, 106.5, 0.0),
            step(1, 4, 107.5, 0.0),
            start(2, 117.5, 121.5, 2, 1.5),
            step(2, 3, 122.5, 0.0),
            step(2, 4, 123.5, 0.0),
            step(2, 5, 124.5, 0.0),
            Record::End { attempt: 2, t: 125.0, outcome: "completed".into(), checkpoint_s: 0.25 },
        ];
        let r = Report::of(&records).unwrap();
        let [a, b] = &r.attempts[..] else { panic!("{r:?}") };
        assert_eq!((a.outcome.as_str(), a.last_step, b.outcome.as_str(), b.last_step), ("killed", 4, "completed", 5));
        assert_eq!(a.figures.wall_s, 7.5);
        assert_eq!(a.figures.productive_s, 3.0);
        assert_eq!(a.figures.badput.startup_other_s, 1.5);
        assert_eq!(a.figures.badput.checkpoint_s, 0.5);
        assert_eq!(a.figures.badput.unaccounted_s, 0.0);
        assert_eq!((b.figures.steps, b.figures.recomputed_steps), (3, 2));
        assert_eq!(b.figures.badput.recomputed_s, 2.0);
        assert_eq!(b.figures.productive_s, 0.75);
        assert_eq!(b.figures.badput.startup_checkpoint_load_s, 1.5);
        assert_eq!(b.figures.badput.startup_other_s, 1.0);
        assert_eq!(b.figures.badput.checkpoint_s, 0.25, "the wait for the last save");
        assert_eq!(b.figures.badput.unaccounted_s, 0.25, "from the last step to the end record");
        assert_eq!(r.run.badput.idle_between_attempts_s, 10.0);
        assert_eq!(r.run.wall_s, 7.5 + 10.0 + 7.5);
        assert_eq!(r.run.productive_s, 3.75);
        assert_eq!(r.run.goodput, 3.75 / 25.0);
        assert_eq!(r.last_attempt.goodput, 0.75 / 7.5);
        // Every second of the run is productive or has a cause.
        let causes: f64 = r.run.badput.causes().iter().map(|(_, s)| s).sum();
        assert!((causes + r.run.productive_s - r.run.wall_s).abs() < 1e-9);
        let table = r.table();
        assert!(table.contains("recomputed steps"), "{table}");
        assert!(table.contains("goodput 10.0 % of the last attempt, 15.0 % of the run"), "{table}");
        assert!(r.scalars().contains(&("badput/run/recomputed_steps".into(), 2.0)));
    }

    /// The file: records appended by attempts, a torn last line left out, the attempts numbered.
    #[test]
    fn the_timeline_is_appended_across_attempts() {
        let dir = tempfile::tempdir().unwrap();
        let mut first = Timeline::begin(dir.path(), 0, Startup::default()).unwrap();
        first.step(step(0, 1, 0.0, 0.0)).unwrap();
        // Killed: no end record.
        std::mem::forget(first);
        let mut file = File::options().append(true).open(dir.path().join(GOODPUT)).unwrap();
        file.write_all(b"{\"kind\":\"step\",\"att").unwrap();
        file.write_all(b"\n").unwrap();
        let mut second = Timeline::begin(dir.path(), 1, Startup::default()).unwrap();
        assert_eq!(second.attempt(), 2);
        second.end("completed", 0.0).unwrap();
        drop(second);
        // Ended by an error: the end is written as it is dropped.
        drop(Timeline::begin(dir.path(), 1, Startup::default()).unwrap());
        let records = read(&dir.path().join(GOODPUT)).unwrap();
        assert_eq!(records.len(), 6);
        let r = Report::of(&records).unwrap();
        let outcomes: Vec<&str> = r.attempts.iter().map(|a| a.outcome.as_str()).collect();
        assert_eq!(outcomes, ["killed", "completed", "failed"]);
        assert!(r.run.wall_s >= r.last_attempt.wall_s);
    }

    /// A line past the bound (here a file without line breaks) and implausible times are
    /// refused, naming the file and the line; a line that does not parse is left out.
    #[test]
    fn long_lines_and_implausible_times_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(GOODPUT);
        let start = r#"{"kind":"start","attempt":1,"t":100.0,"ready_t":101.0,"resumed_after_step":0,"rendezvous_s":0.0,"checkpoint_load_s":0.0,"device_setup_s":0.0}"#;
        std::fs::write(&path, format!("{start}\n{{\"kind\":\"st\n{}", "x".repeat(MAX_LINE + 1))).unwrap();
        let e = read(&path).unwrap_err().to_string();
        assert!(e.contains("goodput.jsonl:3: a line longer than 65536 bytes"), "{e}");
        for (bad, shown) in [("-33.0", "t = -33:"), ("1e308", "t = 1e308:")] {
            std::fs::write(&path, format!("{start}\n{}\n", start.replace("\"t\":100.0", &format!("\"t\":{bad}"))))
                .unwrap();
            let e = read(&path).unwrap_err().to_string();
            assert!(e.contains("goodput.jsonl:2: ") && e.contains(shown), "{bad}: {e}");
        }
        std::fs::write(&path, format!("{start}\n{{\"kind\":\"st\n")).unwrap();
        assert_eq!(read(&path).unwrap().len(), 1);
    }

    #[test]
    fn the_process_started_before_now() {
        let t = process_start();
        assert!(t <= now() && t > now() - 86_400.0 * 365.0, "{t}");
        assert_eq!(utc(0.0), "1970-01-01 00:00:00");
        assert_eq!(utc(1_795_824_000.0), "2026-11-28 00:00:00");
    }
}
