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
//! Then rank 0 listens on the coordinator address, every other rank connects and says who it
//! is, and once all have arrived rank 0 hands each the same payload (NCCL's unique id). A rank
//! that never arrives makes rank 0 fail after the timeout with the missing ranks named, and
//! rank 0 tells the others why.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
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
    let job = if let Some(addr) = get("JAX_COORDINATOR_ADDRESS") {
        let (nodes, per_node, node) = (num("NNODES")?, num("GPUS_PER_NODE")?, num("NODE_RANK")?);
        let local_rank = match get("LOCAL_RANK") {
            Some(_) => num("LOCAL_RANK")?,
            None if per_node == 1 => 0,
            None => bail!(
                "GPUS_PER_NODE = {per_node} but LOCAL_RANK is not set: start one process per GPU with `engine launch --nproc {per_node} -- ...`"
            ),
        };
        let coordinator = match (addr.rsplit_once(':'), get("JAX_COORDINATOR_PORT")) {
            (_, Some(port)) => format!("{}:{port}", addr.rsplit_once(':').map_or(addr.as_str(), |(h, _)| h)),
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
        };
        check(&job, &[("NODE_RANK", node, nodes), ("LOCAL_RANK", local_rank, per_node)])?;
        job
    } else if get("SLURM_PROCID").is_some() {
        let (rank, world, local_rank) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?, num("SLURM_LOCALID")?);
        let nodelist = get("SLURM_JOB_NODELIST")
            .or_else(|| get("SLURM_NODELIST"))
            .ok_or_else(|| anyhow!("SLURM_JOB_NODELIST is not set"))?;
        let host = first_host(&nodelist).ok_or_else(|| anyhow!("SLURM_JOB_NODELIST = `{nodelist}` names no host"))?;
        let port = match get("MASTER_PORT") {
            Some(_) => num("MASTER_PORT")? as u64,
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
        };
        check(&job, &[("SLURM_PROCID", rank, world)])?;
        job
    } else if get("MASTER_ADDR").is_some() || get("RANK").is_some() {
        let (rank, world) = (num("RANK")?, num("WORLD_SIZE")?);
        let local_rank = if get("LOCAL_RANK").is_some() { num("LOCAL_RANK")? } else { rank };
        let local_world = if get("LOCAL_WORLD_SIZE").is_some() { num("LOCAL_WORLD_SIZE")? } else { world };
        let addr = get("MASTER_ADDR").ok_or_else(|| anyhow!("MASTER_ADDR is not set"))?;
        let job = Job {
            rank,
            world,
            local_rank,
            local_world,
            coordinator: format!("{addr}:{}", num("MASTER_PORT")?),
            convention: "torchrun (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK)",
        };
        check(&job, &[("RANK", rank, world)])?;
        job
    } else {
        Job::single()
    };
    if job.world == 0 || job.world % job.local_world != 0 {
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

/// First line every peer sends: protocol name and version, then its rank and world size.
const HELLO: &str = "ENGINE-RENDEZVOUS 1";

/// Meets every process of the job and returns the payload rank 0 made with `payload` (called on
/// rank 0 only). Fails after `timeout` naming the ranks that never arrived.
pub fn rendezvous(job: &Job, timeout: Duration, payload: impl FnOnce() -> Vec<u8>) -> Result<Vec<u8>> {
    if job.world == 1 {
        return Ok(payload());
    }
    if job.rank == 0 { coordinate(job, timeout, payload()) } else { join(job, timeout) }
}

fn coordinate(job: &Job, timeout: Duration, payload: Vec<u8>) -> Result<Vec<u8>> {
    let port = job.coordinator.rsplit_once(':').map(|(_, p)| p).unwrap_or("");
    let listener = TcpListener::bind(format!("0.0.0.0:{port}")).with_context(|| {
        format!("rank 0 cannot listen on port {port} for the rendezvous (coordinator {})", job.coordinator)
    })?;
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + timeout;
    let mut peers: BTreeMap<usize, TcpStream> = BTreeMap::new();
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
            for stream in peers.values_mut() {
                let _ = writeln!(stream, "ERR {reason}");
            }
            bail!(reason);
        }
        match listener.accept() {
            Ok((stream, from)) => {
                stream.set_nonblocking(false)?;
                stream.set_read_timeout(Some(Duration::from_secs(10)))?;
                let mut line = String::new();
                BufReader::new(&stream)
                    .read_line(&mut line)
                    .with_context(|| format!("rendezvous: reading from {from}"))?;
                let fields: Vec<&str> = line.trim().rsplitn(3, ' ').collect();
                let (rank, world) =
                    match (fields.first().map(|s| s.parse::<usize>()), fields.get(1).map(|s| s.parse::<usize>())) {
                        (Some(Ok(world)), Some(Ok(rank))) if line.starts_with(HELLO) => (rank, world),
                        _ => bail!("rendezvous: {from} sent `{}`, not an engine rendezvous hello", line.trim()),
                    };
                if world != job.world || rank == 0 || rank >= job.world {
                    bail!("rendezvous: {from} says it is rank {rank} of {world}, but this job has {} ranks", job.world);
                }
                if peers.insert(rank, stream).is_some() {
                    bail!("rendezvous: two processes claim rank {rank}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(e).context("rendezvous: accepting a connection"),
        }
    }
    for stream in peers.values_mut() {
        writeln!(stream, "OK {}", payload.len())?;
        stream.write_all(&payload)?;
    }
    Ok(payload)
}

fn join(job: &Job, timeout: Duration) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    // Rank 0 may start later than we do: keep trying until the deadline.
    let stream = loop {
        let addrs = job
            .coordinator
            .to_socket_addrs()
            .with_context(|| format!("rendezvous: cannot resolve {}", job.coordinator))?;
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
    let mut writer = stream.try_clone()?;
    writeln!(writer, "{HELLO} {} {}", job.rank, job.world)?;
    // Rank 0 answers when everyone arrived, or says why it gave up; allow for its own timeout.
    stream.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()) + Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).with_context(|| format!("rendezvous: rank {} waiting for rank 0", job.rank))?;
    if let Some(reason) = line.trim().strip_prefix("ERR ") {
        bail!("rendezvous failed; rank 0 says: {reason}");
    }
    let len: usize = line
        .trim()
        .strip_prefix("OK ")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| anyhow!("rendezvous: unexpected reply from rank 0: `{}`", line.trim()))?;
    let mut payload = vec![0u8; len];
    reader.read_exact(&mut payload).context("rendezvous: reading the payload")?;
    Ok(payload)
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
    fn slurm_node_lists() {
        assert_eq!(first_host("node[01-04,07],gpu3").as_deref(), Some("node01"));
        assert_eq!(first_host("a1,a2").as_deref(), Some("a1"));
        assert_eq!(first_host("x[3,5-6]").as_deref(), Some("x3"));
        assert_eq!(first_host("solo").as_deref(), Some("solo"));
        assert_eq!(first_host(""), None);
    }
}
