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
//! says who it is, its job's token, what it brings (the address of its TCP collectives'
//! listener) and its terms: the engine's version and its resolved configuration as `key = value`
//! lines (`job.rs`'s `terms`). Once all have arrived rank 0 compares every rank's terms with its
//! own and, when they agree, hands each the same payload (NCCL's unique id) and what every rank
//! brought. Ranks that disagree would train one job with two recipes (silently, or until a
//! collective's sizes differ), so the job is refused on every rank, naming the keys and both
//! values. Each connection's hello is read on a thread of its own, so a stranger (a port scan, a
//! health probe) is named and dropped without holding anyone up, and a rank of another job
//! (another token) is turned away. A rank that never arrives makes rank 0 fail after the timeout
//! with the missing ranks named, and rank 0 tells the others why: a transient fault
//! ([`Transient`], exit 75), which a restart may not meet again, unlike bad input (exit 2).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

use super::Transient;

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
/// world size, what it brings (the address of its collectives' listener, or `-`) and the length
/// in bytes of its terms, which follow the line.
const PROTOCOL: &str = "ENGINE-RENDEZVOUS";
const VERSION: u32 = 3;

/// The most bytes of terms a rank may send: a resolved configuration is a few KiB as text.
const MAX_TERMS: usize = 1 << 20;

/// Keys of two ranks' terms that differ, at most this many named in the refusal.
const MAX_NAMED: usize = 8;

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
/// rank 0 only). Fails after `timeout` naming the ranks that never arrived, and refuses ranks
/// whose `terms` differ from rank 0's.
pub fn rendezvous(job: &Job, timeout: Duration, terms: &str, payload: impl FnOnce() -> Vec<u8>) -> Result<Vec<u8>> {
    Ok(meet(job, timeout, terms, |_| Ok("-".into()), payload)?.payload)
}

/// Meets every process of the job: each rank brings a one-word string made by `bring` from the
/// local address it reaches rank 0 through (rank 0: the coordinator's) and its `terms` (`key =
/// value` lines every rank must have alike), rank 0 adds `payload`, and every rank learns all of
/// it. A rank that never arrives fails the job with a [`Transient`] error on every rank; terms
/// that differ from rank 0's fail it as bad input, naming the keys.
pub fn meet(
    job: &Job,
    timeout: Duration,
    terms: &str,
    bring: impl FnOnce(IpAddr) -> Result<String>,
    payload: impl FnOnce() -> Vec<u8>,
) -> Result<Meeting> {
    if job.world == 1 {
        return Ok(Meeting { brought: vec![bring(IpAddr::from([127, 0, 0, 1]))?], payload: payload() });
    }
    anyhow::ensure!(
        terms.len() <= MAX_TERMS,
        "the configuration is {} bytes as text, more than the rendezvous carries ({MAX_TERMS})",
        terms.len()
    );
    if job.rank == 0 { coordinate(job, timeout, terms, bring, payload()) } else { join(job, timeout, terms, bring) }
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

/// A rank's hello, as rank 0 reads it.
#[derive(Debug, PartialEq)]
struct Hello {
    token: String,
    rank: usize,
    world: usize,
    brought: String,
    terms: String,
}

/// Why a connection's hello is not one rank 0 can take.
#[derive(Debug, PartialEq)]
enum Unfit {
    /// Not an engine rank at all (a port scan, a health probe): what it sent.
    Stranger(String),
    /// An engine of another rendezvous protocol: its version.
    Protocol(String),
}

/// Reads a connection's hello: its first line (at most 4 KiB), then the terms it announces.
fn read_hello(stream: &TcpStream) -> Result<Hello, Unfit> {
    let mut reader = BufReader::new(stream.take((4096 + MAX_TERMS) as u64));
    let mut line = String::new();
    let _ = (&mut reader).take(4096).read_line(&mut line);
    let stranger = || Unfit::Stranger(line.trim().to_owned());
    let rest = line.trim().strip_prefix(PROTOCOL).ok_or_else(stranger)?.trim_start();
    let (version, rest) = rest.split_once(' ').ok_or_else(stranger)?;
    if version != VERSION.to_string() {
        return Err(Unfit::Protocol(version.to_owned()));
    }
    let f: Vec<&str> = rest.split(' ').collect();
    let [token, rank, world, brought, len] = f[..] else { return Err(stranger()) };
    let parse = |n: &str| n.parse::<usize>().map_err(|_| stranger());
    let (rank, world, len) = (parse(rank)?, parse(world)?, parse(len)?);
    if len > MAX_TERMS {
        return Err(stranger());
    }
    let mut terms = vec![0u8; len];
    reader.read_exact(&mut terms).map_err(|_| stranger())?;
    let terms = String::from_utf8(terms).map_err(|_| stranger())?;
    Ok(Hello { token: token.to_owned(), rank, world, brought: brought.to_owned(), terms })
}

/// The keys whose values differ between rank 0's terms and another rank's, as `key A vs B`
/// (rank 0's value first; `unset` where one has no such key), in key order, the first
/// [`MAX_NAMED`] of them and how many more.
fn differences(ours: &str, theirs: &str) -> String {
    let pairs = |text: &str| -> BTreeMap<String, String> {
        text.lines().filter_map(|l| l.split_once(" = ")).map(|(k, v)| (k.to_owned(), v.to_owned())).collect()
    };
    let (a, b) = (pairs(ours), pairs(theirs));
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    let show = |m: &BTreeMap<String, String>, k: &String| m.get(k).cloned().unwrap_or_else(|| "unset".into());
    let differ: Vec<String> = keys
        .into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| format!("{k} {} vs {}", show(&a, k), show(&b, k)))
        .collect();
    let mut text = differ.iter().take(MAX_NAMED).cloned().collect::<Vec<_>>().join(", ");
    if differ.len() > MAX_NAMED {
        text += &format!(" and {} more", differ.len() - MAX_NAMED);
    }
    text
}

/// Tells a rank why the rendezvous failed: `ERR`, the exit code it should end with (2: bad input,
/// 75: a transient fault) and the reason.
fn refuse(stream: &mut TcpStream, code: i32, reason: &str) {
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    let _ = writeln!(stream, "ERR {code} {reason}");
}

fn coordinate(
    job: &Job,
    timeout: Duration,
    terms: &str,
    bring: impl FnOnce(IpAddr) -> Result<String>,
    payload: Vec<u8>,
) -> Result<Meeting> {
    let listener = listen(job)?;
    let mine = bring(listener.local_addr()?.ip())?;
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + timeout;
    // Each connection's hello is read on a thread of its own, so that a stranger that sends
    // nothing (a port scan, a health probe) holds up no one; strangers are named and dropped.
    let (hellos, arrivals) = std::sync::mpsc::channel::<(SocketAddr, TcpStream, Result<Hello, Unfit>)>();
    let mut peers: BTreeMap<usize, (TcpStream, Hello)> = BTreeMap::new();
    // Tells every rank that arrived why the job fails, and fails it.
    let fail = |peers: &mut BTreeMap<usize, (TcpStream, Hello)>, code: i32, reason: String| -> anyhow::Error {
        for (stream, _) in peers.values_mut() {
            refuse(stream, code, &reason);
        }
        if code == TRANSIENT { Transient(reason).into() } else { anyhow!(reason) }
    };
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
            return Err(fail(&mut peers, TRANSIENT, reason));
        }
        match listener.accept() {
            Ok((stream, from)) => {
                let hellos = hellos.clone();
                std::thread::spawn(move || {
                    let read = stream
                        .set_nonblocking(false)
                        .and_then(|()| stream.set_read_timeout(Some(HELLO_TIMEOUT)))
                        .map_err(|e| Unfit::Stranger(format!("nothing: {e}")))
                        .and_then(|()| read_hello(&stream));
                    let _ = hellos.send((from, stream, read));
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e).context("rendezvous: accepting a connection"),
        }
        while let Ok((from, mut stream, read)) = arrivals.try_recv() {
            let hello = match read {
                Ok(hello) => hello,
                Err(Unfit::Stranger(sent)) => {
                    crate::say!("rendezvous: ignored a connection from {from}: not an engine rank (it sent {sent:?})");
                    continue;
                }
                Err(Unfit::Protocol(theirs)) => {
                    let reason = format!(
                        "{from} speaks rendezvous protocol {theirs}, rank 0 protocol {VERSION}: every rank must run the same engine build ({})",
                        super::engine_version()
                    );
                    refuse(&mut stream, BAD_INPUT, &reason);
                    return Err(fail(&mut peers, BAD_INPUT, format!("rendezvous: {reason}")));
                }
            };
            if hello.token != job.token {
                crate::say!(
                    "rendezvous: ignored rank {} from {from}: it belongs to another job (its token differs)",
                    hello.rank
                );
                refuse(&mut stream, BAD_INPUT, "this coordinator serves another job (the job tokens differ)");
                continue;
            }
            let rank = hello.rank;
            if hello.world != job.world || rank == 0 || rank >= job.world {
                let reason =
                    format!("{from} says it is rank {rank} of {}, but this job has {} ranks", hello.world, job.world);
                refuse(&mut stream, BAD_INPUT, &reason);
                return Err(fail(&mut peers, BAD_INPUT, format!("rendezvous: {reason}")));
            }
            if peers.contains_key(&rank) {
                refuse(&mut stream, BAD_INPUT, &format!("two processes claim rank {rank}"));
                let reason = format!("rendezvous: two processes claim rank {rank} (the second from {from})");
                return Err(fail(&mut peers, BAD_INPUT, reason));
            }
            peers.insert(rank, (stream, hello));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // Every rank has arrived: they must agree on their terms before anything runs.
    let differ: Vec<usize> = peers.iter().filter(|(_, (_, h))| h.terms != terms).map(|(&r, _)| r).collect();
    if let Some(&first) = differ.first() {
        let others = match &differ[1..] {
            [] => String::new(),
            more => {
                format!("; rank(s) {} differ too", more.iter().map(usize::to_string).collect::<Vec<_>>().join(", "))
            }
        };
        let reason = format!(
            "rank {first}'s configuration differs from rank 0's: {}{others}; start every rank with the same engine, recipe and flags",
            differences(terms, &peers[&first].1.terms)
        );
        return Err(fail(&mut peers, BAD_INPUT, reason));
    }
    let brought: Vec<String> = std::iter::once(mine).chain(peers.values().map(|(_, h)| h.brought.clone())).collect();
    for (rank, (stream, _)) in peers.iter_mut() {
        let send = |stream: &mut TcpStream| -> std::io::Result<()> {
            stream.set_write_timeout(Some(HELLO_TIMEOUT))?;
            writeln!(stream, "OK {} {}", payload.len(), brought.join(" "))?;
            stream.write_all(&payload)
        };
        send(stream)
            .map_err(|e| Transient(format!("rendezvous: rank {rank} left before it was told the job's set-up: {e}")))?;
    }
    Ok(Meeting { payload, brought })
}

/// The exit codes rank 0 tells the others to end with: bad input, or a transient fault.
const BAD_INPUT: i32 = 2;
const TRANSIENT: i32 = super::COLLECTIVE_FAILED;

fn join(job: &Job, timeout: Duration, terms: &str, bring: impl FnOnce(IpAddr) -> Result<String>) -> Result<Meeting> {
    let deadline = Instant::now() + timeout;
    // Rank 0 may start later than we do: keep trying until the deadline.
    let stream = loop {
        let addrs = coordinator_addrs(job)?;
        if let Some(s) = addrs.into_iter().find_map(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).ok()) {
            break s;
        }
        if Instant::now() >= deadline {
            return Err(Transient(format!(
                "rendezvous timed out after {:.0} s: rank {} could not reach rank 0 at {} ({})",
                timeout.as_secs_f64(),
                job.rank,
                job.coordinator,
                job.convention
            ))
            .into());
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let brought = bring(stream.local_addr()?.ip())?;
    let mut writer = stream.try_clone()?;
    let hello =
        format!("{PROTOCOL} {VERSION} {} {} {} {brought} {}\n{terms}", job.token, job.rank, job.world, terms.len());
    writer
        .write_all(hello.as_bytes())
        .map_err(|e| Transient(format!("rendezvous: rank 0 at {} closed the connection: {e}", job.coordinator)))?;
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
    let gone = |e: &dyn std::fmt::Display| {
        Transient(format!("rendezvous: rank {} waiting for rank 0 at {}: {e}", job.rank, job.coordinator))
    };
    match (&mut reader).take(4096 + 64 * job.world as u64).read_line(&mut line) {
        Ok(0) => {
            return Err(Transient(format!(
                "rendezvous: rank 0 at {} closed the connection before every rank arrived",
                job.coordinator
            ))
            .into());
        }
        Ok(_) => {}
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
            return Err(Transient(silent()).into());
        }
        Err(e) => return Err(gone(&e).into()),
    }
    if let Some(refusal) = line.trim().strip_prefix("ERR ") {
        let (code, reason) = refusal.split_once(' ').unwrap_or(("", refusal));
        let reason = format!("rendezvous failed; rank 0 says: {reason}");
        return Err(if code == TRANSIENT.to_string() { Transient(reason).into() } else { anyhow!(reason) });
    }
    let bad = || anyhow!("rendezvous: unexpected reply from rank 0: `{}`", line.trim());
    let mut fields = line.trim().strip_prefix("OK ").ok_or_else(bad)?.split(' ');
    let len: usize = fields.next().and_then(|n| n.parse().ok()).ok_or_else(bad)?;
    let brought: Vec<String> = fields.map(str::to_owned).collect();
    if brought.len() != job.world || len > MAX_TERMS {
        return Err(bad());
    }
    let mut payload = vec![0u8; len];
    reader.read_exact(&mut payload).map_err(|e| gone(&format!("reading the payload: {e}")))?;
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

    /// The two ranks of a job on threads, meeting at a fresh port, each with its `terms` and
    /// `timeout`; without `arrive`, rank 1 never comes and rank 0 waits alone.
    fn meet_two(terms: [&'static str; 2], timeout: Duration, arrive: bool) -> [Result<Meeting>; 2] {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let job =
            |rank| Job { rank, world: 2, coordinator: format!("127.0.0.1:{port}"), token: "t".into(), ..Job::single() };
        let ranks: Vec<_> = (0..2)
            .filter(|&rank| rank == 0 || arrive)
            .map(|rank| {
                let job = job(rank);
                std::thread::spawn(move || meet(&job, timeout, terms[rank], |_| Ok("-".into()), Vec::new))
            })
            .collect();
        let mut out = ranks.into_iter().map(|t| t.join().unwrap());
        let zero = out.next().unwrap();
        [zero, out.next().unwrap_or_else(|| Err(anyhow!("did not run")))]
    }

    /// Ranks whose terms differ are refused on every rank, one line naming each key and both
    /// values (rank 0's first); as bad input, not as a transient fault.
    #[test]
    fn ranks_whose_terms_differ_are_refused_naming_the_keys() {
        let ours = "engine = 1\noptim.lr = 0.001\ntrain.seed = 1\ntrain.steps = 3\n";
        let theirs = "engine = 1\noptim.lr = 0.5\ntrain.seed = 1\ntrain.steps = 5\ntrain.extra = true\n";
        let [zero, one] = meet_two([ours, theirs], Duration::from_secs(20), true);
        let want = "rank 1's configuration differs from rank 0's: optim.lr 0.001 vs 0.5, train.extra unset vs true, train.steps 3 vs 5;";
        for (rank, result) in [zero, one].into_iter().enumerate() {
            let e = result.err().unwrap_or_else(|| panic!("rank {rank} was not refused"));
            assert!(e.to_string().contains(want), "rank {rank}: {e}");
            assert!(e.downcast_ref::<Transient>().is_none(), "rank {rank}: bad input, not a transient fault");
            assert!(!e.to_string().contains('\n'), "{e}");
        }
        let [zero, one] = meet_two([ours, ours], Duration::from_secs(20), true);
        assert_eq!(zero.unwrap().brought.len(), 2);
        assert_eq!(one.unwrap().brought.len(), 2);
        let many: String = (0..12).map(|i| format!("k{i:02} = {i}\n")).collect();
        assert_eq!(
            differences("", &many),
            "k00 unset vs 0, k01 unset vs 1, k02 unset vs 2, k03 unset vs 3, k04 unset vs 4, k05 unset vs 5, k06 unset vs 6, k07 unset vs 7 and 4 more"
        );
    }

    /// A rank that never arrives is a transient fault (exit 75), not bad input.
    #[test]
    fn a_rank_that_never_arrives_is_a_transient_fault() {
        let [zero, _] = meet_two(["a = 1\n", "a = 1\n"], Duration::from_millis(300), false);
        let e = zero.err().expect("rank 0 alone times out");
        assert!(e.to_string().contains("rank(s) 1 of 2 never arrived"), "{e}");
        assert!(e.downcast_ref::<Transient>().is_some(), "{e}");
    }

    /// Hellos: an engine rank's, a stranger's, and one of another rendezvous protocol.
    #[test]
    fn hellos_are_read_with_their_terms() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let hello = |bytes: &[u8]| {
            let mut peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            peer.write_all(bytes).unwrap();
            drop(peer);
            read_hello(&listener.accept().unwrap().0)
        };
        let terms = "engine = 1\nk = v\n";
        let text = format!("{PROTOCOL} {VERSION} tok 1 2 10.0.0.1:5 {}\n{terms}", terms.len());
        let want = Hello { token: "tok".into(), rank: 1, world: 2, brought: "10.0.0.1:5".into(), terms: terms.into() };
        assert_eq!(hello(text.as_bytes()), Ok(want));
        assert_eq!(hello(b"GET / HTTP/1.0\r\n\r\n"), Err(Unfit::Stranger("GET / HTTP/1.0".into())));
        assert_eq!(hello(b"ENGINE-RENDEZVOUS 2 tok 1 2 -\n"), Err(Unfit::Protocol("2".into())));
        let huge = format!("{PROTOCOL} {VERSION} tok 1 2 - {}\n", MAX_TERMS + 1);
        assert!(matches!(hello(huge.as_bytes()), Err(Unfit::Stranger(_))));
    }
}
