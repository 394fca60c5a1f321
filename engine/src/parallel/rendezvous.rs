//! Rendezvous: which process am I, and how do all processes of a job meet?
//!
//! Discovery reads the variables the launchers users already have set, first match wins:
//!
//! 1. MaxText / Vertex AI: `JAX_COORDINATOR_ADDRESS`, `JAX_COORDINATOR_PORT`, `NODE_RANK`,
//!    `NNODES`, `GPUS_PER_NODE`, one process per GPU (`LOCAL_RANK`, set by `engine launch`);
//! 2. Slurm, one task per GPU: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the coordinator
//!    being the first host of `SLURM_JOB_NODELIST`;
//! 3. torchrun: `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`.
//!
//! Then rank 0 listens on the coordinator's address (only there), every other rank connects and
//! says who it is, its job's token and what it brings (the address of its TCP collectives'
//! listener), and once all have arrived rank 0 hands each the same payload (NCCL's unique id)
//! and what every rank brought. Each connection's hello is read on a thread of its own, so a
//! stranger (a port scan, a health probe) is named and dropped without holding anyone up, and a
//! rank of another job (another token) is turned away. A rank that never arrives makes rank 0
//! fail after the timeout with the missing ranks named, and rank 0 tells the others why.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

/// Port used when a convention names a coordinator host but no port (Slurm without
/// `MASTER_PORT`): offset by the job id so that jobs sharing a node do not collide.
const SLURM_BASE_PORT: u64 = 29500;

/// Where this process sits in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    /// Global rank, `0..world`.
    pub rank: usize,
    /// Number of processes (one per device).
    pub world: usize,
    /// Rank within this node: the device to use.
    pub local_rank: usize,
    /// Processes per node.
    pub local_world: usize,
    /// `host:port` of rank 0's rendezvous listener.
    pub coordinator: String,
    /// Which convention the variables came from.
    pub convention: &'static str,
    /// What every rank of this job shares and no other job does, so that the rendezvous and
    /// the collectives' connections admit only the job's own ranks (one word; `-` when the
    /// launcher gives none): `ENGINE_JOB_TOKEN` (set by `engine launch`), else Slurm's job and
    /// step ids, else torchrun's `TORCHELASTIC_RUN_ID`.
    pub token: String,
}

impl Job {
    /// A job of one process.
    pub fn single() -> Job {
        Job {
            rank: 0,
            world: 1,
            local_rank: 0,
            local_world: 1,
            coordinator: String::new(),
            convention: "single process",
            token: "-".into(),
        }
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.world / self.local_world
    }
}

/// Reads the job from environment variables (see the module documentation); a single-process
/// job when no convention's variables are set.
pub fn discover(var: impl Fn(&str) -> Option<String>) -> Result<Job> {
    let get = |name: &str| var(name).filter(|v| !v.trim().is_empty());
    let num = |name: &str| -> Result<usize> {
        let v = get(name).ok_or_else(|| anyhow!("{name} is not set"))?;
        v.trim().parse().map_err(|_| anyhow!("{name} = `{v}` is not a non-negative integer"))
    };
    // A count of processes (a world or a node's) is at least one.
    let count = |name: &str| -> Result<usize> {
        match num(name)? {
            0 => bail!("{name} = 0: a job has at least one process (and a node at least one)"),
            n => Ok(n),
        }
    };
    // The port rank 0 listens on: one that other ranks can reach.
    let port = |name: &str| -> Result<usize> {
        match num(name)? {
            p @ 1..=65535 => Ok(p),
            p => bail!("{name} = {p} is not a port other ranks can connect to (1-65535)"),
        }
    };
    let job = if let Some(addr) = get("JAX_COORDINATOR_ADDRESS") {
        let (nodes, per_node, node) = (count("NNODES")?, count("GPUS_PER_NODE")?, num("NODE_RANK")?);
        let local_rank = match get("LOCAL_RANK") {
            Some(_) => num("LOCAL_RANK")?,
            None if per_node == 1 => 0,
            None => bail!(
                "GPUS_PER_NODE = {per_node} but LOCAL_RANK is not set: start one process per GPU with `engine launch --nproc {per_node} -- ...`"
            ),
        };
        let coordinator = match (addr.rsplit_once(':'), get("JAX_COORDINATOR_PORT")) {
            (_, Some(_)) => {
                format!("{}:{}", addr.rsplit_once(':').map_or(addr.as_str(), |(h, _)| h), port("JAX_COORDINATOR_PORT")?)
            }
            (Some(_), None) => addr.clone(),
            (None, None) => bail!("JAX_COORDINATOR_ADDRESS = `{addr}` has no port and JAX_COORDINATOR_PORT is not set"),
        };
        let job = Job {
            rank: node * per_node + local_rank,
            world: nodes * per_node,
            local_rank,
            local_world: per_node,
            coordinator,
            convention: "MaxText/Vertex (JAX_COORDINATOR_ADDRESS, NODE_RANK, NNODES, GPUS_PER_NODE)",
            token: String::new(),
        };
        check(&job, &[("NODE_RANK", node, nodes), ("LOCAL_RANK", local_rank, per_node)])?;
        job
    } else if get("SLURM_PROCID").is_some() {
        let (rank, world, local_rank) = (num("SLURM_PROCID")?, count("SLURM_NTASKS")?, num("SLURM_LOCALID")?);
        let nodelist = get("SLURM_JOB_NODELIST")
            .or_else(|| get("SLURM_NODELIST"))
            .ok_or_else(|| anyhow!("SLURM_JOB_NODELIST is not set"))?;
        let host = first_host(&nodelist).ok_or_else(|| anyhow!("SLURM_JOB_NODELIST = `{nodelist}` names no host"))?;
        let port = match get("MASTER_PORT") {
            Some(_) => port("MASTER_PORT")? as u64,
            None => SLURM_BASE_PORT + get("SLURM_JOB_ID").and_then(|j| j.parse::<u64>().ok()).unwrap_or(0) % 10_000,
        };
        let local_world = match get("SLURM_NTASKS_PER_NODE") {
            Some(v) => v.split('(').next().unwrap_or("").trim().parse().unwrap_or(world),
            None => world / num("SLURM_NNODES").or_else(|_| num("SLURM_JOB_NUM_NODES")).unwrap_or(1).max(1),
        };
        let job = Job {
            rank,
            world,
            local_rank,
            local_world: local_world.max(1),
            coordinator: format!("{host}:{port}"),
            convention: "Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST)",
            token: match (get("SLURM_JOB_ID"), get("SLURM_STEP_ID")) {
                (Some(job), Some(step)) => format!("slurm-{job}.{step}"),
                (Some(job), None) => format!("slurm-{job}"),
                _ => String::new(),
            },
        };
        check(&job, &[("SLURM_PROCID", rank, world)])?;
        job
    } else if get("MASTER_ADDR").is_some() || get("RANK").is_some() {
        let (rank, world) = (num("RANK")?, count("WORLD_SIZE")?);
        let local_rank = if get("LOCAL_RANK").is_some() { num("LOCAL_RANK")? } else { rank };
        let local_world = if get("LOCAL_WORLD_SIZE").is_some() { count("LOCAL_WORLD_SIZE")? } else { world };
        let addr = get("MASTER_ADDR").ok_or_else(|| anyhow!("MASTER_ADDR is not set"))?;
        let job = Job {
            rank,
            world,
            local_rank,
            local_world,
            coordinator: format!("{addr}:{}", port("MASTER_PORT")?),
            convention: "torchrun (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK)",
            token: get("TORCHELASTIC_RUN_ID").unwrap_or_default(),
        };
        check(&job, &[("RANK", rank, world)])?;
        job
    } else {
        Job::single()
    };
    let mut job = job;
    if let Some(token) = get("ENGINE_JOB_TOKEN") {
        job.token = token;
    }
    // One word on the wire; `-` for none.
    job.token = job.token.split_whitespace().collect::<Vec<_>>().join("_");
    if job.token.is_empty() {
        job.token = "-".into();
    }
    if job.world % job.local_world != 0 {
        bail!("{}: {} processes do not fill whole nodes of {}", job.convention, job.world, job.local_world);
    }
    Ok(job)
}

fn check(job: &Job, bounds: &[(&str, usize, usize)]) -> Result<()> {
    for &(name, value, limit) in bounds {
        if value >= limit {
            bail!("{}: {name} = {value} is out of range 0..{limit}", job.convention);
        }
    }
    Ok(())
}

/// The first host of a Slurm node list: `node[01-04,07],gpu3` → `node01`.
pub fn first_host(list: &str) -> Option<String> {
    let first = split_top_level(list).into_iter().next()?.trim().to_owned();
    match first.split_once('[') {
        None => (!first.is_empty()).then_some(first),
        Some((prefix, rest)) => {
            let range = rest.trim_end_matches(']').split(',').next()?;
            let start = range.split('-').next()?;
            Some(format!("{prefix}{start}"))
        }
    }
}

/// Splits at commas outside brackets.
fn split_top_level(list: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&list[start..]);
    parts
}

/// First line every peer sends: protocol name and version, then the job's token, its rank, its
/// world size and what it brings (the address of its collectives' listener, or `-`).
const HELLO: &str = "ENGINE-RENDEZVOUS 2";

/// How long rank 0 waits for a connection's hello before it drops it as a stranger.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// What the rendezvous hands every rank: rank 0's payload, and what each rank brought, in rank
/// order.
pub struct Meeting {
    /// The payload rank 0 made (NCCL's unique id, a check token).
    pub payload: Vec<u8>,
    /// What each rank brought ([`meet`]'s `bring`), in rank order.
    pub brought: Vec<String>,
}

/// Meets every process of the job and returns the payload rank 0 made with `payload` (called on
/// rank 0 only). Fails after `timeout` naming the ranks that never arrived.
pub fn rendezvous(job: &Job, timeout: Duration, payload: impl FnOnce() -> Vec<u8>) -> Result<Vec<u8>> {
    Ok(meet(job, timeout, |_| Ok("-".into()), payload)?.payload)
}

/// Meets every process of the job: each rank brings a one-word string made by `bring` from the
/// local address it reaches rank 0 through (rank 0: the coordinator's), rank 0 adds `payload`,
/// and every rank learns all of it.
pub fn meet(
    job: &Job,
    timeout: Duration,
    bring: impl FnOnce(IpAddr) -> Result<String>,
    payload: impl FnOnce() -> Vec<u8>,
) -> Result<Meeting> {
    if job.world == 1 {
        return Ok(Meeting { brought: vec![bring(IpAddr::from([127, 0, 0, 1]))?], payload: payload() });
    }
    if job.rank == 0 { coordinate(job, timeout, bring, payload()) } else { join(job, timeout, bring) }
}

/// The addresses the coordinator's host name resolves to.
fn coordinator_addrs(job: &Job) -> Result<Vec<SocketAddr>> {
    let addrs: Vec<SocketAddr> = job
        .coordinator
        .to_socket_addrs()
        .with_context(|| {
            format!("rendezvous: cannot resolve the coordinator {} ({})", job.coordinator, job.convention)
        })?
        .collect();
    anyhow::ensure!(!addrs.is_empty(), "rendezvous: the coordinator {} resolves to no address", job.coordinator);
    Ok(addrs)
}

/// Rank 0's listener, on the coordinator's own address (not every interface): the first of its
/// addresses that this host has.
fn listen(job: &Job) -> Result<TcpListener> {
    let mut last = None;
    for addr in coordinator_addrs(job)? {
        match TcpListener::bind(addr) {
            Ok(l) => return Ok(l),
            Err(e) => last = Some((addr, e)),
        }
    }
    let (addr, e) = last.expect("at least one address");
    let hint = match e.kind() {
        std::io::ErrorKind::AddrInUse => ": the port is in use (another job on this node?); choose another port",
        std::io::ErrorKind::AddrNotAvailable => ": rank 0 must run on the coordinator's host",
        _ => "",
    };
    bail!("rank 0 cannot listen on {addr} for the rendezvous (coordinator {}): {e}{hint}", job.coordinator)
}

/// A hello as rank 0 reads it: (rank, world, token, brought).
fn parse_hello(line: &str) -> Option<(usize, usize, &str, &str)> {
    let rest = line.trim().strip_prefix(HELLO)?.trim();
    let f: Vec<&str> = rest.split(' ').collect();
    match f[..] {
        [token, rank, world, brought] => Some((rank.parse().ok()?, world.parse().ok()?, token, brought)),
        _ => None,
    }
}

fn coordinate(
    job: &Job,
    timeout: Duration,
    bring: impl FnOnce(IpAddr) -> Result<String>,
    payload: Vec<u8>,
) -> Result<Meeting> {
    let listener = listen(job)?;
    let mine = bring(listener.local_addr()?.ip())?;
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + timeout;
    // Each connection's hello is read on a thread of its own, so that a stranger that sends
    // nothing (a port scan, a health probe) holds up no one; strangers are named and dropped.
    let (hellos, arrivals) = std::sync::mpsc::channel::<(SocketAddr, TcpStream, std::io::Result<String>)>();
    let mut peers: BTreeMap<usize, (TcpStream, String)> = BTreeMap::new();
    while peers.len() + 1 < job.world {
        if Instant::now() >= deadline {
            let missing: Vec<String> =
                (1..job.world).filter(|r| !peers.contains_key(r)).map(|r| r.to_string()).collect();
            let reason = format!(
                "rendezvous timed out after {:.0} s: rank(s) {} of {} never arrived at {} ({})",
                timeout.as_secs_f64(),
                missing.join(", "),
                job.world,
                job.coordinator,
                job.convention
            );
            for (stream, _) in peers.values_mut() {
                let _ = writeln!(stream, "ERR {reason}");
            }
            bail!(reason);
        }
        match listener.accept() {
            Ok((stream, from)) => {
                let hellos = hellos.clone();
                std::thread::spawn(move || {
                    let mut line = String::new();
                    let read = stream
                        .set_nonblocking(false)
                        .and_then(|()| stream.set_read_timeout(Some(HELLO_TIMEOUT)))
                        .and_then(|()| stream.try_clone())
                        .and_then(|s| BufReader::new(s.take(4096)).read_line(&mut line))
                        .map(|_| line);
                    let _ = hellos.send((from, stream, read));
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e).context("rendezvous: accepting a connection"),
        }
        while let Ok((from, mut stream, read)) = arrivals.try_recv() {
            let line = read.unwrap_or_default();
            let Some((rank, world, token, brought)) = parse_hello(&line) else {
                crate::say!(
                    "rendezvous: ignored a connection from {from}: not an engine rank (it sent {:?})",
                    line.trim()
                );
                continue;
            };
            if token != job.token {
                crate::say!(
                    "rendezvous: ignored rank {rank} from {from}: it belongs to another job (its token differs)"
                );
                let _ = writeln!(stream, "ERR this coordinator serves another job (the job tokens differ)");
                continue;
            }
            if world != job.world || rank == 0 || rank >= job.world {
                let reason = format!("{from} says it is rank {rank} of {world}, but this job has {} ranks", job.world);
                let _ = writeln!(stream, "ERR {reason}");
                bail!("rendezvous: {reason}");
            }
            if peers.contains_key(&rank) {
                let _ = writeln!(stream, "ERR two processes claim rank {rank}");
                bail!("rendezvous: two processes claim rank {rank} (the second from {from})");
            }
            peers.insert(rank, (stream, brought.to_owned()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let brought: Vec<String> = std::iter::once(mine).chain(peers.values().map(|(_, b)| b.clone())).collect();
    for (rank, (stream, _)) in peers.iter_mut() {
        let send = |stream: &mut TcpStream| -> std::io::Result<()> {
            stream.set_write_timeout(Some(HELLO_TIMEOUT))?;
            writeln!(stream, "OK {} {}", payload.len(), brought.join(" "))?;
            stream.write_all(&payload)
        };
        send(stream).with_context(|| format!("rendezvous: rank {rank} left before it was told the job's set-up"))?;
    }
    Ok(Meeting { payload, brought })
}

fn join(job: &Job, timeout: Duration, bring: impl FnOnce(IpAddr) -> Result<String>) -> Result<Meeting> {
    let deadline = Instant::now() + timeout;
    // Rank 0 may start later than we do: keep trying until the deadline.
    let stream = loop {
        let addrs = coordinator_addrs(job)?;
        if let Some(s) = addrs.into_iter().find_map(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).ok()) {
            break s;
        }
        if Instant::now() >= deadline {
            bail!(
                "rendezvous timed out after {:.0} s: rank {} could not reach rank 0 at {} ({})",
                timeout.as_secs_f64(),
                job.rank,
                job.coordinator,
                job.convention
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let brought = bring(stream.local_addr()?.ip())?;
    let mut writer = stream.try_clone()?;
    writeln!(writer, "{HELLO} {} {} {} {brought}", job.token, job.rank, job.world)
        .with_context(|| format!("rendezvous: rank 0 at {} closed the connection", job.coordinator))?;
    // Rank 0 answers when everyone arrived, or says why it gave up; allow for its own timeout.
    let wait = deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(10);
    stream.set_read_timeout(Some(wait))?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    let silent = || {
        format!(
            "rendezvous: rank {} waited {:.0} s for rank 0 at {} to say that every rank arrived, and it said nothing \
             (is rank 0 still running? ENGINE_RENDEZVOUS_TIMEOUT sets the wait)",
            job.rank,
            wait.as_secs_f64(),
            job.coordinator
        )
    };
    match reader.read_line(&mut line) {
        Ok(0) => bail!("rendezvous: rank 0 at {} closed the connection before every rank arrived", job.coordinator),
        Ok(_) => {}
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => bail!(silent()),
        Err(e) => return Err(e).with_context(|| format!("rendezvous: rank {} waiting for rank 0", job.rank)),
    }
    if let Some(reason) = line.trim().strip_prefix("ERR ") {
        bail!("rendezvous failed; rank 0 says: {reason}");
    }
    let bad = || anyhow!("rendezvous: unexpected reply from rank 0: `{}`", line.trim());
    let mut fields = line.trim().strip_prefix("OK ").ok_or_else(bad)?.split(' ');
    let len: usize = fields.next().and_then(|n| n.parse().ok()).ok_or_else(bad)?;
    let brought: Vec<String> = fields.map(str::to_owned).collect();
    if brought.len() != job.world {
        return Err(bad());
    }
    let mut payload = vec![0u8; len];
    reader.read_exact(&mut payload).context("rendezvous: reading the payload")?;
    Ok(Meeting { payload, brought })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn conventions_in_order() {
        let vertex = [
            ("JAX_COORDINATOR_ADDRESS", "10.0.0.2"),
            ("JAX_COORDINATOR_PORT", "2222"),
            ("NODE_RANK", "1"),
            ("NNODES", "2"),
            ("GPUS_PER_NODE", "8"),
            ("LOCAL_RANK", "3"),
            ("RANK", "0"),
        ];
        let j = discover(env(&vertex)).unwrap();
        assert_eq!((j.rank, j.world, j.local_rank, j.nodes(), j.coordinator.as_str()), (11, 16, 3, 2, "10.0.0.2:2222"));
        let e = discover(env(&vertex[..5])).unwrap_err().to_string();
        assert!(e.contains("LOCAL_RANK is not set") && e.contains("engine launch --nproc 8"), "{e}");
        let slurm = [
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "5"),
            ("SLURM_NTASKS_PER_NODE", "8(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[017-018]"),
            ("SLURM_JOB_ID", "4242"),
        ];
        let j = discover(env(&slurm)).unwrap();
        assert_eq!((j.rank, j.world, j.local_world, j.coordinator.as_str()), (5, 16, 8, "gpu017:33742"));
        let torch = [
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29400"),
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "2"),
        ];
        assert_eq!(discover(env(&torch)).unwrap().coordinator, "127.0.0.1:29400");
        assert_eq!(discover(env(&[])).unwrap(), Job::single());
        let bad = [("MASTER_ADDR", "h"), ("MASTER_PORT", "1"), ("RANK", "4"), ("WORLD_SIZE", "4")];
        assert!(discover(env(&bad)).unwrap_err().to_string().contains("RANK = 4 is out of range 0..4"));
        let bad = [("MASTER_ADDR", "h"), ("MASTER_PORT", "1"), ("RANK", "x"), ("WORLD_SIZE", "4")];
        assert!(discover(env(&bad)).unwrap_err().to_string().contains("RANK = `x`"));
    }

    #[test]
    fn counts_and_ports_are_checked_in_one_line() {
        let torch = |world: &str, local: &str, port: &str| {
            let vars = [
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", port),
                ("RANK", "0"),
                ("WORLD_SIZE", world),
                ("LOCAL_WORLD_SIZE", local),
            ];
            discover(env(&vars)).unwrap_err().to_string()
        };
        assert!(torch("0", "1", "29500").contains("WORLD_SIZE = 0: a job has at least one process"));
        assert!(torch("2", "0", "29500").contains("LOCAL_WORLD_SIZE = 0"));
        assert!(torch("2", "2", "0").contains("MASTER_PORT = 0 is not a port"));
        assert!(torch("2", "2", "70000").contains("MASTER_PORT = 70000 is not a port"));
        let vertex = [
            ("JAX_COORDINATOR_ADDRESS", "h"),
            ("JAX_COORDINATOR_PORT", "0"),
            ("NODE_RANK", "0"),
            ("NNODES", "1"),
            ("GPUS_PER_NODE", "1"),
        ];
        assert!(discover(env(&vertex)).unwrap_err().to_string().contains("JAX_COORDINATOR_PORT = 0"));
    }

    #[test]
    fn the_job_token_comes_from_the_launcher() {
        let slurm = [
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_JOB_NODELIST", "n[1-2]"),
            ("SLURM_JOB_ID", "42"),
            ("SLURM_STEP_ID", "0"),
        ];
        assert_eq!(discover(env(&slurm)).unwrap().token, "slurm-42.0");
        let mine = [&slurm[..], &[("ENGINE_JOB_TOKEN", "abc def")]].concat();
        assert_eq!(discover(env(&mine)).unwrap().token, "abc_def");
        assert_eq!(discover(env(&[])).unwrap().token, "-");
    }

    /// Rank 0 listens on the coordinator's address only, not on every interface.
    #[test]
    fn rank_0_binds_to_the_coordinators_address() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let job = Job { coordinator: format!("127.0.0.1:{port}"), world: 2, ..Job::single() };
        let listener = listen(&job).unwrap();
        assert_eq!(listener.local_addr().unwrap().to_string(), format!("127.0.0.1:{port}"));
        let taken = listen(&job).unwrap_err().to_string();
        assert!(taken.contains("in use"), "{taken}");
    }

    #[test]
    fn slurm_node_lists() {
        assert_eq!(first_host("node[01-04,07],gpu3").as_deref(), Some("node01"));
        assert_eq!(first_host("a1,a2").as_deref(), Some("a1"));
        assert_eq!(first_host("x[3,5-6]").as_deref(), Some("x3"));
        assert_eq!(first_host("solo").as_deref(), Some("solo"));
        assert_eq!(first_host(""), None);
    }
}
