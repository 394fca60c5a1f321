//! The launch templates in recipes/launch/, read as a cluster operator would: each parses, uses
//! the dated image, runs the engine with `--resume=auto` so that a restarted job continues, and
//! sets the variables from which the engine derives every rank — checked by feeding those
//! variables to the engine's own rank discovery.
//!
//! The Slurm script also runs here, under stand-ins for `srun` and `scontrol`: in its bare-metal
//! mode the stand-in `srun` starts this build's engine, which trains; the signal paths (the time
//! limit's SIGUSR1, Slurm's SIGTERM) run against a stand-in task. tests/e2e/slurm.sh runs it under
//! a real Slurm. The Kubernetes manifest is checked against the structure of the Kubernetes API
//! objects it uses (fields, types, the Job controller's rules), offline.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use engine::parallel::rendezvous::discover;
use yaml_rust2::{Yaml, YamlLoader};

const IMAGE: &str = "registry.example/llm/engine:engine-2026-11-21";

/// The engine's exit code for a run stopped by a signal with a checkpoint of its step.
const STOPPED_EXIT: i32 = 76;

fn template(name: &str) -> String {
    std::fs::read_to_string(template_path(name)).unwrap()
}

fn template_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../recipes/launch").join(name)
}

/// `envsubst` restricted to the given variables, as the templates' usage lines say.
fn envsubst(text: &str, vars: &[(&str, &str)]) -> String {
    vars.iter().fold(text.to_owned(), |t, (k, v)| t.replace(&format!("${{{k}}}"), v))
}

fn lookup(vars: BTreeMap<String, String>) -> impl Fn(&str) -> Option<String> {
    move |k| vars.get(k).cloned()
}

// --- Slurm ------------------------------------------------------------------------------------

/// The `#SBATCH --KEY[=VALUE]` lines (a flag without a value maps to "").
fn sbatch_options(text: &str) -> BTreeMap<&str, &str> {
    text.lines()
        .filter_map(|l| l.strip_prefix("#SBATCH --"))
        .map(|l| l.split_once('=').unwrap_or((l.trim(), "")))
        .collect()
}

#[test]
fn slurm_script_runs_one_task_per_gpu_is_requeueable_and_warned_before_its_time_limit() {
    let text = template("slurm.sbatch");
    let syntax = Command::new("bash").arg("-n").arg(template_path("slurm.sbatch")).output().unwrap();
    assert!(syntax.status.success(), "bash -n: {}", String::from_utf8_lossy(&syntax.stderr));

    let sbatch = sbatch_options(&text);
    assert_eq!(sbatch["ntasks-per-node"], sbatch["gpus-per-node"], "one task per GPU");
    // Requeued (preemption, `scontrol requeue`, its own requeue at the time limit), and warned
    // with SIGUSR1 to the batch shell (B:) long enough before the limit to save a checkpoint.
    assert!(sbatch.contains_key("requeue"), "{sbatch:?}");
    let warning = sbatch["signal"].strip_prefix("B:USR1@").expect("--signal=B:USR1@SECONDS");
    assert!(warning.parse::<u32>().unwrap() >= 120, "{warning} s before the time limit is too short to save");
    assert_eq!(sbatch["open-mode"], "append", "a requeued job keeps the log of its earlier starts");
    // What Slurm sets for task 11 of 2 nodes x 8 tasks: the engine must see rank 11 of 16, and
    // rank 0's port is the job's own (the template leaves MASTER_PORT to the engine).
    assert!(!text.contains("MASTER_PORT="), "the engine derives the port from the job id");
    let per_node: usize = sbatch["ntasks-per-node"].parse().unwrap();
    let env: BTreeMap<String, String> = [
        ("SLURM_PROCID", "11".to_string()),
        ("SLURM_NTASKS", (2 * per_node).to_string()),
        ("SLURM_LOCALID", "3".to_string()),
        ("SLURM_NTASKS_PER_NODE", format!("{per_node}(x2)")),
        ("SLURM_JOB_NODELIST", "gpu[101-102]".to_string()),
        ("SLURM_JOB_ID", "123456".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let job = discover(lookup(env)).unwrap();
    assert_eq!((job.rank, job.world, job.local_rank, job.coordinator.as_str()), (11, 16, 3, "gpu101:32956"));
}

/// slurm.sbatch run by bash as Slurm runs a batch script, with stand-ins for `srun` and
/// `scontrol` first on PATH: `srun` writes its arguments and environment to files and runs
/// `$STUB_TASK` (a script) or its own command; `scontrol` writes its arguments.
struct SlurmScript {
    dir: tempfile::TempDir,
}

const STUB_SRUN: &str = r#"#!/usr/bin/env bash
printf '%s\n' "$@" >"$STUB_DIR/srun.args"
env >"$STUB_DIR/srun.env"
echo $$ >"$STUB_DIR/srun.pid"
if [ -n "${STUB_TASK:-}" ]; then exec bash "$STUB_TASK"; fi
# srun's own options come first; the task is the rest.
while [ "$#" -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"#;

const STUB_SCONTROL: &str = r#"#!/usr/bin/env bash
printf '%s\n' "$*" >>"$STUB_DIR/scontrol.calls"
"#;

/// A task that waits for a signal and exits as the engine does when it has saved: 76.
const STOPPING_TASK: &str = r#"trap 'echo USR1 >"$STUB_DIR/task.signal"; exit 76' USR1
trap 'echo TERM >"$STUB_DIR/task.signal"; exit 76' TERM
touch "$STUB_DIR/task.ready"
for _ in $(seq 1 300); do sleep 0.1; done
exit 9
"#;

impl SlurmScript {
    fn new() -> SlurmScript {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("bin")).unwrap();
        for (name, text) in [("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL)] {
            let path = dir.path().join("bin").join(name);
            std::fs::write(&path, text).unwrap();
            std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        }
        SlurmScript { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn read(&self, name: &str) -> String {
        std::fs::read_to_string(self.path(name)).unwrap_or_default()
    }

    /// Starts the script with `vars` (and what Slurm sets for job 4242) and `args`, in a clean
    /// environment.
    fn start(&self, vars: &[(&str, &str)], args: &[&str]) -> Child {
        let path = format!("{}:{}", self.path("bin").display(), std::env::var("PATH").unwrap_or_default());
        let mut cmd = Command::new("bash");
        cmd.arg(template_path("slurm.sbatch")).args(args).current_dir(self.dir.path()).env_clear();
        cmd.env("PATH", path).env("HOME", self.dir.path()).env("STUB_DIR", self.dir.path());
        for (k, v) in [("SLURM_JOB_ID", "4242"), ("SLURM_JOB_NODELIST", "n[1-2]"), ("SLURM_CPUS_PER_TASK", "1")] {
            cmd.env(k, v);
        }
        for (k, v) in vars {
            cmd.env(k, v);
        }
        cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        cmd.spawn().unwrap()
    }

    /// Runs the script to its end; its status and output.
    fn run(&self, vars: &[(&str, &str)], args: &[&str]) -> (ExitStatus, String) {
        let out = self.start(vars, args).wait_with_output().unwrap();
        (out.status, format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
    }

    /// Waits until the file `name` exists.
    fn wait_for(&self, name: &str) {
        let start = Instant::now();
        while !self.path(name).exists() {
            assert!(start.elapsed() < Duration::from_secs(20), "{name} did not appear");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `signal` (a `kill -s` name) to a process.
    fn kill(&self, signal: &str, pid: u32) {
        assert!(Command::new("kill").args(["-s", signal, &pid.to_string()]).status().unwrap().success());
    }

    fn srun_args(&self) -> Vec<String> {
        self.read("srun.args").lines().map(str::to_owned).collect()
    }
}

/// The mesh and recipe arguments the template gives `engine train` with the defaults.
const MESH_ARGS: [&str; 10] = [
    "--set",
    "mesh.ici_data=1",
    "--set",
    "mesh.ici_fsdp=-1",
    "--set",
    "mesh.dcn_data=-1",
    "--set",
    "mesh.dcn_pipeline=1",
    "--set",
    "train.pipeline_microbatches=1",
];

#[test]
fn slurm_container_mode_runs_the_image_with_the_run_directory_mounted() {
    let s = SlurmScript::new();
    let run_dir = s.path("runs/a");
    let run_dir = run_dir.to_str().unwrap();
    let (status, out) = s.run(
        &[("IMAGE", IMAGE), ("RUN_DIR", run_dir), ("STUB_TASK", "/dev/null")],
        &["--steps", "7", "--set", "train.checkpoint_every=100"],
    );
    assert!(status.success(), "{out}");
    let mut want: Vec<String> = [
        "--kill-on-bad-exit=0",
        &format!("--container-image={IMAGE}"),
        &format!("--container-mounts={run_dir}:/run-dir"),
        "engine",
        "train",
        "--resume=auto",
        "--run-dir",
        "/run-dir",
        "--device",
        "cuda",
        "--recipe",
        "llama3-8b",
    ]
    .map(str::to_owned)
    .to_vec();
    want.extend(MESH_ARGS.map(str::to_owned));
    want.extend(["--steps", "7", "--set", "train.checkpoint_every=100"].map(str::to_owned));
    assert_eq!(s.srun_args(), want);
    assert!(Path::new(run_dir).is_dir(), "the script makes the run directory");
    assert!(out.contains("engine-train: job 4242 start 0 at "), "{out}");
    assert_eq!(s.read("scontrol.calls"), "", "a finished run is not requeued");
    // ENGINE_THREADS follows --cpus-per-task only on the CPU.
    assert!(!s.read("srun.env").contains("ENGINE_THREADS="));
}

#[test]
fn slurm_bare_metal_mode_runs_the_engine_binary_with_the_given_device() {
    let s = SlurmScript::new();
    let run_dir = s.path("runs/tiny");
    let engine = env!("CARGO_BIN_EXE_engine");
    let vars = [
        ("IMAGE", ""),
        ("ENGINE", engine),
        ("DEVICE", "cpu"),
        ("RECIPE", "tiny-llama2"),
        ("RUN_DIR", run_dir.to_str().unwrap()),
    ];
    let shrink = ["--set", "model.vocab_size=512", "--set", "train.seq_len=32", "--set", "model.mlp_dim=1024"];
    let args = [&["--steps", "2"][..], &shrink].concat();
    let (status, out) = s.run(&vars, &args);
    assert!(status.success(), "{out}");
    let got = s.srun_args();
    let head = [
        "--kill-on-bad-exit=0",
        engine,
        "train",
        "--resume=auto",
        "--run-dir",
        run_dir.to_str().unwrap(),
        "--device",
        "cpu",
        "--recipe",
        "tiny-llama2",
    ];
    assert_eq!(got[..head.len()], head.map(str::to_owned), "{got:?}");
    assert_eq!(got[got.len() - args.len()..], args.iter().map(|a| a.to_string()).collect::<Vec<_>>());
    assert!(s.read("srun.env").lines().any(|l| l == "ENGINE_THREADS=1"), "threads = --cpus-per-task on the CPU");
    // The engine trained in RUN_DIR.
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2, "{metrics}");

    // IMAGE unset is bare metal too, and a failure is passed on, not requeued.
    let s = SlurmScript::new();
    let (status, out) = s.run(&[("ENGINE", "/nonexistent/engine")], &[]);
    assert_eq!(status.code(), Some(127), "{out}");
    assert_eq!(s.srun_args()[1], "/nonexistent/engine");
    assert!(s.srun_args().contains(&"cuda".to_owned()), "DEVICE defaults to cuda");
    assert_eq!(s.read("scontrol.calls"), "");
}

#[test]
fn slurm_time_limit_warning_reaches_the_tasks_and_the_script_requeues_the_job() {
    let s = SlurmScript::new();
    std::fs::write(s.path("task.sh"), STOPPING_TASK).unwrap();
    let task = s.path("task.sh");
    let script = s.start(&[("STUB_TASK", task.to_str().unwrap()), ("RUN_DIR", "runs/b")], &[]);
    s.wait_for("task.ready");
    // What --signal=B:USR1@300 sends: SIGUSR1 to the batch shell only.
    s.kill("USR1", script.id());
    let out = script.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(STOPPED_EXIT), "{log}");
    assert_eq!(s.read("task.signal"), "USR1\n", "the script passes the warning on to the tasks");
    assert_eq!(s.read("scontrol.calls"), "requeue 4242\n");
    assert!(log.contains("requeueing job 4242"), "{log}");
}

#[test]
fn slurm_sigterm_from_slurm_is_left_to_slurm() {
    // Preemption, `scontrol requeue` and scancel: Slurm signals the batch shell and every task
    // itself, and requeues the job (or not) itself: the script must not requeue it again.
    let s = SlurmScript::new();
    std::fs::write(s.path("task.sh"), STOPPING_TASK).unwrap();
    let task = s.path("task.sh");
    let script = s.start(&[("STUB_TASK", task.to_str().unwrap()), ("RUN_DIR", "runs/c")], &[]);
    s.wait_for("task.ready");
    s.kill("TERM", script.id());
    let srun: u32 = s.read("srun.pid").trim().parse().unwrap();
    s.kill("TERM", srun);
    let out = script.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(STOPPED_EXIT), "{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(s.read("task.signal"), "TERM\n");
    assert_eq!(s.read("scontrol.calls"), "", "Slurm requeues a preempted job itself");
}

// --- Kubernetes -------------------------------------------------------------------------------

fn env_list(container: &Yaml) -> BTreeMap<String, String> {
    container["env"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap().to_owned(), e["value"].as_str().unwrap().to_owned()))
        .collect()
}

fn kubernetes_docs() -> Vec<Yaml> {
    let vars = [("IMAGE", IMAGE), ("NODES", "2"), ("RECIPE", "llama3-8b"), ("PIPELINE", "2"), ("MICROBATCHES", "4")];
    let text = envsubst(&template("kubernetes.yaml"), &vars);
    YamlLoader::load_from_str(&text).unwrap()
}

#[test]
fn kubernetes_indexed_job_names_image_command_and_rendezvous() {
    let docs = kubernetes_docs();
    assert_eq!(docs.len(), 2);
    let (service, job) = (&docs[0], &docs[1]);
    assert_eq!((service["kind"].as_str(), job["kind"].as_str()), (Some("Service"), Some("Job")));
    let spec = &job["spec"];
    assert_eq!(spec["completionMode"].as_str(), Some("Indexed"));
    assert_eq!((spec["completions"].as_i64(), spec["parallelism"].as_i64()), (Some(2), Some(2)));
    let pod = &spec["template"]["spec"];
    let container = &pod["containers"][0];
    assert_eq!(container["image"].as_str(), Some(IMAGE));
    let script = container["command"][2].as_str().unwrap();
    assert!(
        script.contains("NODE_RANK=$JOB_COMPLETION_INDEX")
            && script.contains("engine launch --nproc \"$GPUS_PER_NODE\" -- train")
    );
    let env = env_list(container);
    // A pipeline mesh across the nodes.
    assert_eq!((env["PIPELINE"].as_str(), env["MICROBATCHES"].as_str()), ("2", "4"));
    assert!(
        script.contains("--set mesh.dcn_pipeline=\"$PIPELINE\" --set train.pipeline_microbatches=\"$MICROBATCHES\"")
    );
    let gpus = container["resources"]["limits"]["nvidia.com/gpu"].as_i64().unwrap();
    assert_eq!(env["GPUS_PER_NODE"], gpus.to_string());
    // Pod 0 is reachable as <job>-0.<subdomain>, and the subdomain is the headless Service.
    let name = job["metadata"]["name"].as_str().unwrap();
    assert_eq!(pod["subdomain"].as_str(), service["metadata"]["name"].as_str());
    assert_eq!(env["JAX_COORDINATOR_ADDRESS"], format!("{name}-0.{}", pod["subdomain"].as_str().unwrap()));
    assert_eq!(service["spec"]["ports"][0]["port"].as_i64().unwrap().to_string(), env["JAX_COORDINATOR_PORT"]);
    // Process 5 on pod 1, as `engine launch` starts it.
    let mut vars = env.clone();
    vars.insert("NODE_RANK".into(), "1".into());
    vars.insert("LOCAL_RANK".into(), "5".into());
    let job = discover(lookup(vars)).unwrap();
    assert_eq!((job.rank, job.world, job.nodes()), (13, 16, 2));
    assert_eq!(job.coordinator, "engine-train-0.engine-train:2222");
}

#[test]
fn kubernetes_job_restarts_failed_pods_which_resume_from_a_shared_run_directory() {
    let docs = kubernetes_docs();
    let spec = &docs[1]["spec"];
    assert!(spec["backoffLimit"].as_i64().unwrap() > 0, "a failed pod is replaced");
    let pod = &spec["template"]["spec"];
    let container = &pod["containers"][0];
    let script = container["command"][2].as_str().unwrap();
    assert!(script.contains("train --resume=auto --run-dir \"/runs/$RECIPE\""), "{script}");
    // The run directory outlives the pods and is shared by them: a ReadWriteMany claim, not a
    // pod's own emptyDir.
    let mount = container["volumeMounts"].as_vec().unwrap().iter().find(|m| m["mountPath"].as_str() == Some("/runs"));
    let volume = mount.expect("/runs is mounted")["name"].as_str().unwrap();
    let volume = pod["volumes"].as_vec().unwrap().iter().find(|v| v["name"].as_str() == Some(volume)).unwrap();
    assert!(volume["persistentVolumeClaim"]["claimName"].as_str().is_some(), "{volume:?}");
    // SIGTERM (eviction, preemption) leaves the ranks time to save their step.
    assert!(pod["terminationGracePeriodSeconds"].as_i64().unwrap() >= 120);

    // Which failures count towards backoffLimit: the first rule that matches a failed pod decides.
    let rules = spec["podFailurePolicy"]["rules"].as_vec().unwrap();
    let action = |code: i64, conditions: &[&str]| -> &str {
        for rule in rules {
            let on_codes = &rule["onExitCodes"];
            let matches = if on_codes.is_badvalue() {
                rule["onPodConditions"]
                    .as_vec()
                    .unwrap()
                    .iter()
                    .any(|p| conditions.contains(&p["type"].as_str().unwrap()))
            } else {
                let listed = on_codes["values"].as_vec().unwrap().iter().any(|v| v.as_i64() == Some(code));
                listed == (on_codes["operator"].as_str() == Some("In"))
            };
            if matches {
                return rule["action"].as_str().unwrap();
            }
        }
        "Count"
    };
    assert_eq!(action(2, &[]), "FailJob", "bad input: retrying cannot help");
    assert_eq!(action(STOPPED_EXIT as i64, &[]), "Ignore", "stopped by SIGTERM with a checkpoint");
    assert_eq!(action(75, &[]), "Ignore", "a collective failed because another rank left");
    assert_eq!(action(137, &["DisruptionTarget"]), "Ignore", "preempted or evicted");
    assert_eq!(action(137, &[]), "Count", "killed, out of memory");
    assert_eq!(action(101, &[]), "Count", "a crash");
}

/// A field's type in [`KUBERNETES`]: a scalar, a map of strings or quantities, an object type
/// named in the table, or a list of one (`[]Type`).
const KUBERNETES: &[(&str, &[(&str, &str)])] = &[
    ("Service", &[("apiVersion", "string"), ("kind", "string"), ("metadata", "ObjectMeta"), ("spec", "ServiceSpec")]),
    ("Job", &[("apiVersion", "string"), ("kind", "string"), ("metadata", "ObjectMeta"), ("spec", "JobSpec")]),
    ("ObjectMeta", &[("name", "string"), ("namespace", "string"), ("labels", "map"), ("annotations", "map")]),
    (
        "ServiceSpec",
        &[
            ("clusterIP", "string"),
            ("selector", "map"),
            ("ports", "[]ServicePort"),
            ("type", "string"),
            ("publishNotReadyAddresses", "boolean"),
        ],
    ),
    (
        "ServicePort",
        &[("name", "string"), ("port", "integer"), ("targetPort", "int-or-string"), ("protocol", "string")],
    ),
    (
        "JobSpec",
        &[
            ("activeDeadlineSeconds", "integer"),
            ("backoffLimit", "integer"),
            ("backoffLimitPerIndex", "integer"),
            ("completionMode", "string"),
            ("completions", "integer"),
            ("maxFailedIndexes", "integer"),
            ("parallelism", "integer"),
            ("podFailurePolicy", "PodFailurePolicy"),
            ("podReplacementPolicy", "string"),
            ("suspend", "boolean"),
            ("template", "PodTemplateSpec"),
            ("ttlSecondsAfterFinished", "integer"),
        ],
    ),
    ("PodFailurePolicy", &[("rules", "[]PodFailurePolicyRule")]),
    (
        "PodFailurePolicyRule",
        &[
            ("action", "string"),
            ("onExitCodes", "PodFailurePolicyOnExitCodesRequirement"),
            ("onPodConditions", "[]PodFailurePolicyOnPodConditionsPattern"),
        ],
    ),
    (
        "PodFailurePolicyOnExitCodesRequirement",
        &[("containerName", "string"), ("operator", "string"), ("values", "[]integer")],
    ),
    ("PodFailurePolicyOnPodConditionsPattern", &[("type", "string"), ("status", "string")]),
    ("PodTemplateSpec", &[("metadata", "ObjectMeta"), ("spec", "PodSpec")]),
    (
        "PodSpec",
        &[
            ("containers", "[]Container"),
            ("restartPolicy", "string"),
            ("subdomain", "string"),
            ("hostname", "string"),
            ("terminationGracePeriodSeconds", "integer"),
            ("volumes", "[]Volume"),
            ("nodeSelector", "map"),
            ("serviceAccountName", "string"),
            ("priorityClassName", "string"),
        ],
    ),
    (
        "Container",
        &[
            ("name", "string"),
            ("image", "string"),
            ("command", "[]string"),
            ("args", "[]string"),
            ("env", "[]EnvVar"),
            ("ports", "[]ContainerPort"),
            ("resources", "ResourceRequirements"),
            ("volumeMounts", "[]VolumeMount"),
            ("workingDir", "string"),
            ("imagePullPolicy", "string"),
        ],
    ),
    ("EnvVar", &[("name", "string"), ("value", "string")]),
    ("ContainerPort", &[("containerPort", "integer"), ("name", "string"), ("protocol", "string")]),
    ("ResourceRequirements", &[("limits", "quantities"), ("requests", "quantities")]),
    ("VolumeMount", &[("name", "string"), ("mountPath", "string"), ("readOnly", "boolean"), ("subPath", "string")]),
    (
        "Volume",
        &[
            ("name", "string"),
            ("emptyDir", "EmptyDirVolumeSource"),
            ("persistentVolumeClaim", "PersistentVolumeClaimVolumeSource"),
        ],
    ),
    ("EmptyDirVolumeSource", &[("medium", "string"), ("sizeLimit", "quantity")]),
    ("PersistentVolumeClaimVolumeSource", &[("claimName", "string"), ("readOnly", "boolean")]),
];

/// A Kubernetes resource quantity (`8`, `64Gi`, `500m`, `1.5`, `1e3`).
fn is_quantity(v: &Yaml) -> bool {
    match v {
        Yaml::Integer(n) => *n >= 0,
        Yaml::Real(_) => true,
        Yaml::String(s) => {
            let number_end = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
            let suffix = &s[number_end..];
            number_end > 0
                && ["", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"].contains(&suffix)
        }
        _ => false,
    }
}

/// Every field of `v` at `path` is a field of the Kubernetes type `ty`, with a value of its type.
fn check_type(v: &Yaml, ty: &str, path: &str, errors: &mut Vec<String>) {
    if let Some(item) = ty.strip_prefix("[]") {
        match v.as_vec() {
            Some(items) => {
                items.iter().enumerate().for_each(|(i, x)| check_type(x, item, &format!("{path}[{i}]"), errors))
            }
            None => errors.push(format!("{path}: expected a list of {item}, got {v:?}")),
        }
        return;
    }
    let ok = match ty {
        "string" => v.as_str().is_some(),
        "integer" => v.as_i64().is_some(),
        "boolean" => v.as_bool().is_some(),
        "int-or-string" => v.as_i64().is_some() || v.as_str().is_some(),
        "quantity" => is_quantity(v),
        "map" => v.as_hash().is_some_and(|h| h.iter().all(|(k, x)| k.as_str().is_some() && x.as_str().is_some())),
        "quantities" => v.as_hash().is_some_and(|h| h.iter().all(|(k, x)| k.as_str().is_some() && is_quantity(x))),
        _ => {
            let Some((_, fields)) = KUBERNETES.iter().find(|(name, _)| *name == ty) else {
                panic!("{ty} is not in the table")
            };
            let Some(object) = v.as_hash() else {
                errors.push(format!("{path}: expected a {ty} object, got {v:?}"));
                return;
            };
            for (key, value) in object {
                let key = key.as_str().unwrap_or("?");
                match fields.iter().find(|(f, _)| *f == key) {
                    Some((_, field_ty)) => check_type(value, field_ty, &format!("{path}.{key}"), errors),
                    None => errors.push(format!("{path}: {ty} has no field `{key}`")),
                }
            }
            true
        }
    };
    if !ok {
        errors.push(format!("{path}: expected {ty}, got {v:?}"));
    }
}

/// What the API server's validation of a Job and a Service adds to the types (the rules these
/// manifests could break).
fn check_rules(service: &Yaml, job: &Yaml, errors: &mut Vec<String>) {
    let mut rule = |ok: bool, what: &str| {
        if !ok {
            errors.push(what.to_owned());
        }
    };
    let dns_label = |s: &str| {
        !s.is_empty()
            && s.len() <= 63
            && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !s.starts_with('-')
            && !s.ends_with('-')
    };
    rule(service["apiVersion"].as_str() == Some("v1"), "a Service is v1");
    rule(job["apiVersion"].as_str() == Some("batch/v1"), "a Job is batch/v1");
    for name in [&service["metadata"]["name"], &job["metadata"]["name"]] {
        rule(name.as_str().is_some_and(dns_label), "names are DNS labels");
    }
    let port = service["spec"]["ports"][0]["port"].as_i64().unwrap_or(0);
    rule((1..=65535).contains(&port), "a Service port is in 1..65535");

    let spec = &job["spec"];
    let pod = &spec["template"]["spec"];
    rule(matches!(spec["completionMode"].as_str(), None | Some("NonIndexed" | "Indexed")), "completionMode");
    rule(
        spec["completionMode"].as_str() != Some("Indexed") || spec["completions"].as_i64().is_some(),
        "Indexed needs completions",
    );
    rule(spec["backoffLimit"].as_i64().is_none_or(|b| b >= 0), "backoffLimit >= 0");
    rule(
        matches!(pod["restartPolicy"].as_str(), Some("Never" | "OnFailure")),
        "a Job's pods restart Never or OnFailure",
    );
    let containers: Vec<&str> =
        pod["containers"].as_vec().map_or(vec![], |c| c.iter().filter_map(|c| c["name"].as_str()).collect());
    rule(!containers.is_empty() && containers.iter().all(|c| dns_label(c)), "containers have DNS-label names");
    let volumes: Vec<&str> =
        pod["volumes"].as_vec().map_or(vec![], |v| v.iter().filter_map(|v| v["name"].as_str()).collect());
    rule(volumes.iter().collect::<BTreeSet<_>>().len() == volumes.len(), "volume names are unique");
    for c in pod["containers"].as_vec().into_iter().flatten() {
        for m in c["volumeMounts"].as_vec().into_iter().flatten() {
            rule(m["name"].as_str().is_some_and(|n| volumes.contains(&n)), "every volumeMount names a volume");
        }
    }
    for v in pod["volumes"].as_vec().into_iter().flatten() {
        let sources = ["emptyDir", "persistentVolumeClaim"].iter().filter(|s| !v[**s].is_badvalue()).count();
        rule(sources == 1, "a volume has one source");
        rule(matches!(v["emptyDir"]["medium"].as_str(), None | Some("" | "Memory")), "emptyDir.medium");
    }
    let policy = &spec["podFailurePolicy"];
    if !policy.is_badvalue() {
        rule(pod["restartPolicy"].as_str() == Some("Never"), "podFailurePolicy needs restartPolicy: Never");
        for r in policy["rules"].as_vec().into_iter().flatten() {
            let action = r["action"].as_str();
            rule(matches!(action, Some("FailJob" | "FailIndex" | "Ignore" | "Count")), "a rule's action");
            rule(
                action != Some("FailIndex") || !spec["backoffLimitPerIndex"].is_badvalue(),
                "FailIndex needs backoffLimitPerIndex",
            );
            let (codes, conditions) = (&r["onExitCodes"], &r["onPodConditions"]);
            rule(
                codes.is_badvalue() != conditions.is_badvalue(),
                "a rule has onExitCodes or onPodConditions, not both",
            );
            if !codes.is_badvalue() {
                let op = codes["operator"].as_str();
                rule(matches!(op, Some("In" | "NotIn")), "onExitCodes.operator is In or NotIn");
                let values: Vec<i64> =
                    codes["values"].as_vec().map_or(vec![], |v| v.iter().filter_map(Yaml::as_i64).collect());
                rule((1..=255).contains(&values.len()), "onExitCodes has 1 to 255 values");
                rule(values.windows(2).all(|w| w[0] < w[1]), "onExitCodes.values are ordered, without duplicates");
                rule(op != Some("In") || !values.contains(&0), "0 cannot be listed with In");
                if let Some(name) = codes["containerName"].as_str() {
                    rule(containers.contains(&name), "onExitCodes.containerName names a container");
                }
            }
            for p in conditions.as_vec().into_iter().flatten() {
                rule(p["type"].as_str().is_some(), "onPodConditions names a type");
                rule(matches!(p["status"].as_str(), None | Some("True" | "False" | "Unknown")), "a condition's status");
            }
        }
    }
}

#[test]
fn kubernetes_manifest_has_the_structure_of_the_api_objects() {
    let docs = kubernetes_docs();
    let mut errors = Vec::new();
    check_type(&docs[0], "Service", "Service", &mut errors);
    check_type(&docs[1], "Job", "Job", &mut errors);
    check_rules(&docs[0], &docs[1], &mut errors);
    assert!(errors.is_empty(), "recipes/launch/kubernetes.yaml:\n{}", errors.join("\n"));

    // The check sees the mistakes it is there for.
    let broken = [
        ("backoffLimit: 3", "backoffLimit: \"3\"", "Job.spec.backoffLimit: expected integer"),
        ("restartPolicy: Never", "restartPolicy: Always", "restartPolicy"),
        ("values: [75, 76]", "values: [76, 75]", "ordered"),
        (
            "terminationGracePeriodSeconds: 300",
            "terminationGracePeriod: 300",
            "PodSpec has no field `terminationGracePeriod`",
        ),
        ("claimName: engine-train-runs", "claimname: engine-train-runs", "has no field `claimname`"),
        (
            "containerName: engine\n          operator: In\n          values: [2]",
            "containerName: main\n          operator: In\n          values: [2]",
            "containerName",
        ),
    ];
    let vars = [("IMAGE", IMAGE), ("NODES", "2"), ("RECIPE", "r"), ("PIPELINE", "1"), ("MICROBATCHES", "1")];
    for (from, to, want) in broken {
        let text = envsubst(&template("kubernetes.yaml"), &vars);
        assert!(text.contains(from), "{from}");
        let docs = YamlLoader::load_from_str(&text.replacen(from, to, 1)).unwrap();
        let mut errors = Vec::new();
        check_type(&docs[0], "Service", "Service", &mut errors);
        check_type(&docs[1], "Job", "Job", &mut errors);
        check_rules(&docs[0], &docs[1], &mut errors);
        assert!(errors.iter().any(|e| e.contains(want)), "{to}: {errors:?}");
    }
}

// --- Vertex AI --------------------------------------------------------------------------------

#[test]
fn vertex_custom_job_names_image_command_and_environment() {
    let vars = [("IMAGE", IMAGE), ("RECIPE", "llama3-8b"), ("BUCKET", "my-bucket"), ("NODES", "2"), ("WORKERS", "1")];
    let job: serde_json::Value = serde_json::from_str(&envsubst(&template("vertex.json"), &vars)).unwrap();
    // A worker restarted (maintenance, a failure) restarts the whole job: the ranks meet again.
    assert_eq!(job["jobSpec"]["scheduling"]["restartJobOnWorkerRestart"], true);
    let pools = job["jobSpec"]["workerPoolSpecs"].as_array().unwrap();
    let replicas: usize = pools.iter().map(|p| p["replicaCount"].as_str().unwrap().parse::<usize>().unwrap()).sum();
    for pool in pools {
        let c = &pool["containerSpec"];
        assert_eq!(c["imageUri"], IMAGE);
        let script = c["command"][2].as_str().unwrap();
        assert!(
            script.contains(
                "engine launch --nproc $GPUS_PER_NODE -- train --resume=auto --run-dir /gcs/$BUCKET/runs/$RECIPE --recipe $RECIPE"
            ),
            "{script}"
        );
        let env: BTreeMap<String, String> = c["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["name"].as_str().unwrap().to_owned(), e["value"].as_str().unwrap().to_owned()))
            .collect();
        assert_eq!(env["NNODES"].parse::<usize>().unwrap(), replicas, "NNODES matches the replicas of all pools");
        assert_eq!(env["GPUS_PER_NODE"], pool["machineSpec"]["acceleratorCount"].to_string());
        // Vertex sets MASTER_ADDR and RANK (the node) on every replica; the command maps them.
        let mut vars = env.clone();
        vars.insert("JAX_COORDINATOR_ADDRESS".into(), "10.1.0.2".into());
        vars.insert("NODE_RANK".into(), "1".into());
        vars.insert("LOCAL_RANK".into(), "7".into());
        vars.insert("RANK".into(), "1".into());
        let job = discover(lookup(vars)).unwrap();
        assert_eq!((job.rank, job.world, job.coordinator.as_str()), (15, 16, "10.1.0.2:2222"));
    }
}
