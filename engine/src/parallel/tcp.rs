//! Collectives between processes over TCP: the CPU's twin of NCCL, so that a job of many
//! processes (`engine launch --nproc N -- train --device cpu`, Slurm, torchrun) trains without
//! GPUs, as Gloo's TCP transport does for PyTorch.
//!
//! Every two ranks of the job hold one connection (a full mesh, made once after the
//! rendezvous). A thread per connection reads the peer's messages into mailboxes, one per
//! (peer, lane), so that a send never waits for the receiver to be ready and two ranks sending
//! to each other never deadlock. Lanes keep apart what runs concurrently: the step's own
//! collectives, the started ones (run on a worker thread while the passes go on), and the
//! pipeline's point-to-point messages; within a lane, messages between two ranks arrive in order.
//!
//! **The same sums as [`Virtual`].** Each element of a sum is `0 + x₀ + x₁ + …` in group order,
//! whoever adds it, so that a job of N processes follows the `--devices N` curve bit for bit:
//! - reduce-scatter sends each member the part of the buffer it owns, and each adds the parts
//!   it receives in group order (bytes sent per rank: (n−1)/n of the buffer, as a ring's);
//! - all-gather sends the input to every member;
//! - all-reduce is a reduce-scatter over n nearly equal chunks, then an all-gather of the sums.
//!
//! A ring would add each chunk in a rotated order; a tree in yet another. Neither gives the
//! virtual devices' sums, which is why this is not a ring, and why this is hand-written rather
//! than MPI (whose reductions choose their own order, and which a GPU image would have to carry).
//!
//! **The watchdog.** Every receive waits at most `ENGINE_COLLECTIVE_TIMEOUT` seconds (socket
//! deadlines bound every send too). A peer that closes its connection (it died, or gave up)
//! is seen at once. Either way the rank prints one line naming the collective, the axis, the
//! step and the ranks that did not answer, tells its peers why it stops (so that they name the
//! first cause, not the rank that gave up after it), and exits with [`COLLECTIVE_FAILED`]: the
//! [`Collectives`] calls return nothing, and a job that lost a rank cannot go on anyway.
//!
//! **Frames.** Every message is a frame: a kind byte (the lane, or [`ABORT`]) and a length (f32
//! elements; bytes of text for an abort), little-endian, then the body. A receiving collective
//! knows how many elements each peer must send it, and a frame of any other length ends the
//! rank as a lost peer does (exit 75), naming the peer, the lane and the length, as soon as its
//! header arrives; its body is read in parts as it comes ([`read_body`]), so a header that
//! claims 2^61 elements costs no more memory than the bytes the peer really sent.
//!
//! **Test hook.** `ENGINE_TEST_PANIC_READER=1` ([`PANIC_HOOK`]) makes every reader thread panic
//! at its first frame: the tests use it to show that a panic on a helper thread ends the process
//! at once (exit 101) rather than leaving its rank to wait out the collective timeout.
//!
//! [`Virtual`]: super::comm::Virtual

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::comm::{Collectives, all_to_all_part};
use super::rendezvous::{self, Job};
use super::{COLLECTIVE_FAILED, Transient};
use crate::backend::{Backend, View};

/// The test hook's variable (see the [module documentation](self)).
pub const PANIC_HOOK: &str = "ENGINE_TEST_PANIC_READER";

/// Which stream of messages between two ranks a message belongs to.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[repr(u8)]
pub enum Lane {
    /// The collectives the step waits for.
    Step = 0,
    /// Collectives started and waited for later (the worker thread's).
    Started = 1,
    /// Pipeline activations and gradients.
    PointToPoint = 2,
}

impl Lane {
    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Lane::Step => "step",
            Lane::Started => "started-collectives",
            Lane::PointToPoint => "pipeline",
        }
    }
}

/// A frame's kind byte for "this rank stops; the text says why".
const ABORT: u8 = 255;

/// The longest text an abort frame may carry, in bytes.
const MAX_ABORT_TEXT: u64 = 4096;

/// Elements of a frame's body read at a time: what a header alone can make a reader allocate.
const BODY_PART: usize = 1 << 18;

/// A frame's header: 9 bytes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    /// `len` f32 elements on `lane`.
    Data {
        /// The lane the message belongs to.
        lane: Lane,
        /// Elements that follow (as the sender says: checked against what the receiver expects).
        len: u64,
    },
    /// The sender stops: `len` bytes of text say why.
    Abort {
        /// Bytes of text that follow.
        len: u64,
    },
}

impl Header {
    /// Reads a header's 9 bytes: a kind byte (a lane, or [`ABORT`]) and a little-endian length.
    /// Fails on a kind no engine sends, and on an abort text longer than any engine sends.
    pub fn parse(head: [u8; 9]) -> Result<Header, String> {
        let len = u64::from_le_bytes(head[1..].try_into().expect("8 bytes"));
        let lane = match head[0] {
            0 => Lane::Step,
            1 => Lane::Started,
            2 => Lane::PointToPoint,
            ABORT if len <= MAX_ABORT_TEXT => return Ok(Header::Abort { len }),
            ABORT => return Err(format!("it sent a stop message of {len} bytes (at most {MAX_ABORT_TEXT})")),
            k => return Err(format!("it sent a frame of unknown kind {k}")),
        };
        Ok(Header::Data { lane, len })
    }

    /// The header's 9 bytes.
    pub fn bytes(self) -> [u8; 9] {
        let (kind, len) = match self {
            Header::Data { lane, len } => (lane as u8, len),
            Header::Abort { len } => (ABORT, len),
        };
        let mut head = [kind; 9];
        head[1..].copy_from_slice(&len.to_le_bytes());
        head
    }
}

/// Why a peer's frame is refused: `len` elements on `lane`, where the receiving collective
/// expects `want`. `None` when it is the length expected.
pub fn unexpected(peer: usize, lane: Lane, len: u64, want: usize) -> Option<String> {
    (len != want as u64).then(|| {
        format!(
            "rank {peer} sent a frame of {len} elements on the {} lane where {want} were expected (a peer of another recipe or engine, or not an engine rank)",
            lane.name()
        )
    })
}

/// A frame as its receiver takes it.
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// A message on a lane.
    Data {
        /// The lane it belongs to.
        lane: Lane,
        /// Its elements.
        body: Vec<f32>,
    },
    /// The sender's word that it stops, and why.
    Abort(String),
}

/// Reads the next frame of a peer's connection: its header ([`Header::parse`]), then its body
/// in parts as it arrives ([`read_body`]); `arriving` is told a message's lane and length as
/// soon as its header is read, before its body. Fails with the reason the connection is of no
/// further use: it closed, it broke, or it sent what no engine sends.
pub fn next_frame(stream: &mut impl Read, arriving: impl FnOnce(Lane, u64)) -> Result<Frame, String> {
    let broke = |e: std::io::Error| format!("its connection failed in the middle of a message: {e}");
    let mut head = [0u8; 9];
    stream.read_exact(&mut head).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => "it closed its connection (the process ended)".to_owned(),
        _ => format!("its connection failed: {e}"),
    })?;
    match Header::parse(head)? {
        Header::Abort { len } => {
            let mut text = vec![0u8; len as usize];
            stream.read_exact(&mut text).map_err(broke)?;
            Ok(Frame::Abort(String::from_utf8_lossy(&text).into_owned()))
        }
        Header::Data { lane, len } => {
            arriving(lane, len);
            Ok(Frame::Data { lane, body: read_body(stream, len).map_err(broke)? })
        }
    }
}

/// Reads a frame's body of `len` elements from `stream`, in parts of [`BODY_PART`] elements: the
/// buffer grows with the bytes that arrive, not with what the header claims.
pub fn read_body(stream: &mut impl Read, len: u64) -> std::io::Result<Vec<f32>> {
    let mut data: Vec<f32> = Vec::new();
    while (data.len() as u64) < len {
        let start = data.len();
        let part = (len - start as u64).min(BODY_PART as u64) as usize;
        data.resize(start + part, 0.0);
        stream.read_exact(bytemuck::cast_slice_mut(&mut data[start..]))?;
    }
    Ok(data)
}

/// First line of each mesh connection: protocol, job token, the connecting rank.
const HELLO: &str = "ENGINE-TCP 1";

/// How long a mesh connection has to say which rank it is before it is dropped as a stranger.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// One rank's collectives over TCP.
pub struct Tcp {
    net: Arc<Net>,
    staging: Vec<f32>,
    /// The started operations' worker, once started.
    worker: Option<Worker>,
    pending: usize,
}

/// A started operation: all-reduce (`true`) or all-gather, its input, its output buffer, group.
type Started = (bool, Vec<f32>, View, Vec<usize>);

/// Where started operations go, and where their results come back from.
type Worker = (Sender<Started>, Receiver<(View, Vec<f32>)>);

/// The connections of one rank, shared by the step's thread, the worker and the readers.
struct Net {
    rank: usize,
    /// One writer per peer (none for this rank).
    writers: Vec<Option<Mutex<TcpStream>>>,
    inbox: Mutex<Inbox>,
    arrived: Condvar,
    timeout: Duration,
    /// The optimizer step in progress, for messages.
    step: AtomicU64,
    /// Names of the mesh's groups (axes), for messages.
    names: Mutex<Vec<(Vec<usize>, String)>>,
    /// Bytes this rank has sent to its peers (frames and their headers).
    sent: AtomicU64,
    /// The test hook: readers panic at their first frame ([`PANIC_HOOK`]).
    panic_hook: bool,
}

#[derive(Default)]
struct Inbox {
    queues: HashMap<(usize, Lane), VecDeque<Incoming>>,
    /// Peers whose connection closed or broke, and the cause as a clause (`rank 2 left the
    /// job: ...`).
    gone: HashMap<usize, String>,
    /// A peer's word that it stopped, and why.
    aborted: Option<String>,
}

/// A message on its way in: its length as its header says, as soon as the header arrives, and
/// its body once all of it has.
struct Incoming {
    len: u64,
    body: Option<Vec<f32>>,
}

impl Tcp {
    /// Joins the job: meets every rank through the rendezvous (each brings the address of a
    /// listener on the interface it reaches rank 0 through), then connects to every other rank
    /// (each rank dials the lower ranks and accepts the higher ones).
    /// A rank whose `terms` differ from rank 0's is refused ([`rendezvous::meet`]). Peers that
    /// do not arrive or connect in time fail it with a [`Transient`] error.
    pub fn connect(job: &Job, rendezvous_timeout: Duration, timeout: Duration, terms: &str) -> Result<Tcp> {
        let mut listener = None;
        let meeting = rendezvous::meet(
            job,
            rendezvous_timeout,
            terms,
            |ip: IpAddr| {
                let l = TcpListener::bind(SocketAddr::new(ip, 0))
                    .with_context(|| format!("rank {} cannot listen on {ip} for its peers", job.rank))?;
                let addr = l.local_addr()?;
                listener = Some(l);
                Ok(addr.to_string())
            },
            Vec::new,
        )?;
        let listener = listener.expect("the rendezvous asked for the address");
        let deadline = Instant::now() + rendezvous_timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..job.world).map(|_| None).collect();
        for (peer, addr) in meeting.brought.iter().enumerate().take(job.rank) {
            let stream = dial(addr, deadline)
                .and_then(|s| (&s).write_all(format!("{HELLO} {} {}\n", job.token, job.rank).as_bytes()).map(|()| s))
                .map_err(|e| Transient(format!("rank {} cannot reach rank {peer} at {addr}: {e}", job.rank)))?;
            streams[peer] = Some(stream);
        }
        accept_higher(job, &listener, deadline, &mut streams)?;
        let mut writers = Vec::with_capacity(job.world);
        let mut readers = Vec::with_capacity(job.world);
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else {
                writers.push(None);
                continue;
            };
            stream.set_nodelay(true)?;
            stream.set_write_timeout(Some(timeout))?;
            readers.push((peer, stream.try_clone()?));
            writers.push(Some(Mutex::new(stream)));
        }
        let net = Arc::new(Net {
            rank: job.rank,
            writers,
            inbox: Mutex::new(Inbox::default()),
            arrived: Condvar::new(),
            timeout,
            step: AtomicU64::new(0),
            names: Mutex::new(Vec::new()),
            sent: AtomicU64::new(0),
            panic_hook: std::env::var(PANIC_HOOK).is_ok_and(|v| v == "1"),
        });
        for (peer, reader) in readers {
            let net = net.clone();
            std::thread::Builder::new()
                .name(format!("tcp-from-{peer}"))
                .spawn(move || read_from(&net, peer, reader))
                .context("starting a reader thread")?;
        }
        Ok(Tcp { net, staging: Vec::new(), worker: None, pending: 0 })
    }
}

/// Connects to `addr`, retrying until `deadline` (the peer may still be starting its listener).
fn dial(addr: &str, deadline: Instant) -> std::io::Result<TcpStream> {
    let to: SocketAddr = addr.parse().map_err(|_| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("`{addr}` is not a socket address"))
    })?;
    loop {
        match TcpStream::connect_timeout(&to, Duration::from_secs(2)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Accepts one connection from every rank above this one; strangers and other jobs' ranks are
/// named and dropped. Each connection's hello is read on a thread of its own, as the
/// rendezvous reads its hellos, so that a connection that says nothing delays no one.
fn accept_higher(
    job: &Job,
    listener: &TcpListener,
    deadline: Instant,
    streams: &mut [Option<TcpStream>],
) -> Result<()> {
    listener.set_nonblocking(true)?;
    let (hellos, arrivals) = std::sync::mpsc::channel::<(SocketAddr, TcpStream, String)>();
    let mut missing: Vec<usize> = (job.rank + 1..job.world).collect();
    while !missing.is_empty() {
        match listener.accept() {
            Ok((stream, from)) => {
                let hellos = hellos.clone();
                std::thread::spawn(move || {
                    let read =
                        stream.set_nonblocking(false).and_then(|()| stream.set_read_timeout(Some(HELLO_TIMEOUT)));
                    let line = if read.is_ok() { hello_line(&stream) } else { String::new() };
                    let _ = hellos.send((from, stream, line));
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let names: Vec<String> = missing.iter().map(usize::to_string).collect();
                    return Err(Transient(format!(
                        "rank {}: rank(s) {} never connected to it after the rendezvous",
                        job.rank,
                        names.join(", ")
                    ))
                    .into());
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e).context("accepting a peer's connection"),
        }
        while let Ok((from, stream, line)) = arrivals.try_recv() {
            let rank = line
                .trim()
                .strip_prefix(HELLO)
                .and_then(|rest| rest.trim().split_once(' '))
                .filter(|(token, _)| *token == job.token)
                .and_then(|(_, rank)| rank.parse::<usize>().ok())
                .filter(|r| missing.contains(r));
            match rank {
                Some(rank) => {
                    stream.set_read_timeout(None)?;
                    missing.retain(|&r| r != rank);
                    streams[rank] = Some(stream);
                }
                None => crate::say!("rank {}: ignored a connection from {from}: not a rank of this job", job.rank),
            }
        }
    }
    Ok(())
}

/// The first line of a connection, read a byte at a time: the peer's frames may follow it at
/// once, and a buffered reader would take them along and lose them.
fn hello_line(mut stream: &TcpStream) -> String {
    let mut line = Vec::new();
    let mut byte = [0u8];
    while line.len() < 256 && matches!(stream.read(&mut byte), Ok(1)) && byte[0] != b'\n' {
        line.push(byte[0]);
    }
    String::from_utf8_lossy(&line).into_owned()
}

/// A reader thread: moves `peer`'s frames into the inbox until the connection closes. A
/// message's length is in the inbox as soon as its header arrives, for the receiver to check;
/// its body follows as it comes.
fn read_from(net: &Net, peer: usize, stream: TcpStream) {
    let mut stream = std::io::BufReader::with_capacity(1 << 16, stream);
    let arriving = |lane: Lane, len: u64| {
        if net.panic_hook {
            panic!("{PANIC_HOOK}=1: the reader of rank {peer}'s frames panics on purpose");
        }
        let mut inbox = net.inbox.lock().expect("inbox");
        inbox.queues.entry((peer, lane)).or_default().push_back(Incoming { len, body: None });
        net.arrived.notify_all();
    };
    let why = loop {
        match next_frame(&mut stream, arriving) {
            Ok(Frame::Data { lane, body }) => {
                let mut inbox = net.inbox.lock().expect("inbox");
                // Only this thread adds to the peer's queues, and the receiver takes only whole
                // messages: the last one is the one arriving.
                let last = inbox.queues.get_mut(&(peer, lane)).and_then(VecDeque::back_mut);
                last.expect("the message arriving").body = Some(body);
            }
            Ok(Frame::Abort(text)) => {
                net.inbox.lock().expect("inbox").aborted.get_or_insert(text);
            }
            Err(why) => break why,
        }
        net.arrived.notify_all();
    };
    net.inbox.lock().expect("inbox").gone.insert(peer, format!("rank {peer} left the job: {why}"));
    net.arrived.notify_all();
}

/// What a collective is, for the watchdog's message.
struct Call<'a> {
    op: &'static str,
    group: &'a [usize],
}

impl Net {
    fn describe(&self, call: &Call) -> String {
        let names = self.names.lock().expect("names");
        let axis = match names.iter().find(|(g, _)| g == call.group) {
            Some((_, name)) => format!("the {name} axis (ranks {:?})", call.group),
            None => format!("ranks {:?}", call.group),
        };
        let step = self.step.load(Ordering::Relaxed);
        let at = if step == 0 { "before the first step".to_owned() } else { format!("at step {step}") };
        format!("rank {}: {} over {axis} {at}", self.rank, call.op)
    }

    /// Stops this process: one line naming the collective and the cause, the flight record
    /// written ([`super::flight::on_failure`], with `suspects`, the ranks it waited for), the
    /// peers told why.
    fn fail(&self, call: &Call, cause: &str, suspects: &[usize]) -> ! {
        let line = format!("{}: {cause}", self.describe(call));
        crate::say!("error: {line}");
        super::flight::on_failure(&line, suspects);
        let text = line.as_bytes();
        for writer in self.writers.iter().flatten() {
            // A writer held by a stuck send is skipped: that peer is the one not answering.
            if let Ok(mut w) = writer.try_lock() {
                let _ = w.set_write_timeout(Some(Duration::from_secs(1)));
                let text = &text[..text.len().min(MAX_ABORT_TEXT as usize)];
                let mut frame = Header::Abort { len: text.len() as u64 }.bytes().to_vec();
                frame.extend_from_slice(text);
                let _ = w.write_all(&frame);
            }
        }
        std::process::exit(COLLECTIVE_FAILED);
    }

    fn send(&self, call: &Call, to: usize, lane: Lane, data: &[f32]) {
        let Some(writer) = &self.writers[to] else { panic!("internal error: rank {to} sends to itself over TCP") };
        let mut w = writer.lock().expect("writer");
        let head = Header::Data { lane, len: data.len() as u64 }.bytes();
        let sent = w.write_all(&head).and_then(|()| w.write_all(bytemuck::cast_slice(data)));
        drop(w);
        self.sent.fetch_add((head.len() + 4 * data.len()) as u64, Ordering::Relaxed);
        if let Err(e) = sent {
            let gone = self.inbox.lock().expect("inbox").gone.get(&to).cloned();
            let cause = match (gone, e.kind()) {
                (Some(cause), _) => cause,
                (None, std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => format!(
                    "rank {to} took no data for {:.0} s (ENGINE_COLLECTIVE_TIMEOUT): is it stopped or stuck?",
                    self.timeout.as_secs_f64()
                ),
                // Its end closed before its reader here saw the connection go: it left too.
                (
                    None,
                    std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted,
                ) => format!("rank {to} left the job: its connection failed: {e}"),
                (None, _) => format!("sending to rank {to} failed: {e}"),
            };
            self.fail(call, &cause, &[to]);
        }
    }

    /// One message from each of `from` on `lane`, in the order of `from`, of `want[i]` elements
    /// from `from[i]`: a message of another length fails the collective as soon as its header
    /// arrives.
    fn recv_all(&self, call: &Call, from: &[usize], lane: Lane, want: &[usize]) -> Vec<Vec<f32>> {
        let deadline = Instant::now() + self.timeout;
        let mut inbox = self.inbox.lock().expect("inbox");
        loop {
            let mut waiting = Vec::new();
            for (&peer, &want) in from.iter().zip(want) {
                match inbox.queues.get(&(peer, lane)).and_then(VecDeque::front) {
                    Some(next) => {
                        if let Some(cause) = unexpected(peer, lane, next.len, want) {
                            drop(inbox);
                            self.fail(call, &cause, &[peer]);
                        }
                        if next.body.is_none() {
                            waiting.push(peer);
                        }
                    }
                    None => waiting.push(peer),
                }
            }
            if waiting.is_empty() {
                return from
                    .iter()
                    .map(|&p| {
                        let next = inbox.queues.get_mut(&(p, lane)).and_then(VecDeque::pop_front);
                        next.and_then(|m| m.body).expect("a whole message")
                    })
                    .collect();
            }
            if let Some(why) = &inbox.aborted {
                let cause = format!("a peer stopped the job: {why}");
                drop(inbox);
                self.fail(call, &cause, &[]);
            }
            if let Some((peer, cause)) = waiting.iter().find_map(|p| inbox.gone.get(p).map(|c| (*p, c.clone()))) {
                drop(inbox);
                self.fail(call, &cause, &[peer]);
            }
            let now = Instant::now();
            if now >= deadline {
                drop(inbox);
                let names: Vec<String> = waiting.iter().map(usize::to_string).collect();
                self.fail(
                    call,
                    &format!(
                        "rank(s) {} did not answer within {:.0} s (ENGINE_COLLECTIVE_TIMEOUT): stopped, stuck, or far behind",
                        names.join(", "),
                        self.timeout.as_secs_f64()
                    ),
                    &waiting,
                );
            }
            inbox = self.arrived.wait_timeout(inbox, deadline - now).expect("inbox").0;
        }
    }

    /// The members of `group` other than this rank, in group order, and this rank's position.
    fn others(&self, group: &[usize]) -> (Vec<usize>, usize) {
        let me = group.iter().position(|&r| r == self.rank).unwrap_or_else(|| {
            panic!("internal error: rank {} is not in group {group:?}", self.rank);
        });
        (group.iter().copied().filter(|&r| r != self.rank).collect(), me)
    }

    /// `Σ_group data[part i]` for this rank's part `i` (`parts` bounds), in group order.
    fn reduce_scatter(&self, call: &Call, lane: Lane, data: &[f32], parts: &[std::ops::Range<usize>]) -> Vec<f32> {
        let (others, me) = self.others(call.group);
        for (i, &peer) in call.group.iter().enumerate() {
            if peer != self.rank {
                self.send(call, peer, lane, &data[parts[i].clone()]);
            }
        }
        let mine = &parts[me];
        let mut received = self.recv_all(call, &others, lane, &vec![mine.len(); others.len()]).into_iter();
        let mut sum = vec![0f32; mine.len()];
        for &member in call.group {
            let got;
            let part = if member == self.rank {
                &data[mine.clone()]
            } else {
                got = received.next().expect("a part");
                &got
            };
            sum.iter_mut().zip(part).for_each(|(s, x)| *s += x);
        }
        sum
    }

    /// Every member's `data`, concatenated in group order.
    fn all_gather(&self, call: &Call, lane: Lane, data: &[f32]) -> Vec<f32> {
        let (others, _) = self.others(call.group);
        for &peer in &others {
            self.send(call, peer, lane, data);
        }
        let mut received = self.recv_all(call, &others, lane, &vec![data.len(); others.len()]).into_iter();
        let mut all = Vec::with_capacity(data.len() * call.group.len());
        for &member in call.group {
            if member == self.rank {
                all.extend_from_slice(data);
            } else {
                all.extend(received.next().expect("a part"));
            }
        }
        all
    }

    /// The all-to-all in equal parts ([`Collectives::all_to_all`]): part `i` of `data` to
    /// member `i`; the parts that came to this rank, its own included, in group order.
    fn all_to_all(&self, call: &Call, lane: Lane, data: &[f32]) -> Vec<f32> {
        let (others, me) = self.others(call.group);
        let part = data.len() / call.group.len();
        for (i, &peer) in call.group.iter().enumerate() {
            if peer != self.rank {
                self.send(call, peer, lane, &data[i * part..(i + 1) * part]);
            }
        }
        let mut received = self.recv_all(call, &others, lane, &vec![part; others.len()]).into_iter();
        let mut all = Vec::with_capacity(data.len());
        for &member in call.group {
            if member == self.rank {
                all.extend_from_slice(&data[me * part..(me + 1) * part]);
            } else {
                all.extend(received.next().expect("a part"));
            }
        }
        all
    }

    /// `Σ_group data`, each element added in group order: a reduce-scatter over nearly equal
    /// chunks, then an all-gather of the chunks' sums.
    fn all_reduce(&self, call: &Call, lane: Lane, data: &[f32]) -> Vec<f32> {
        let n = call.group.len();
        let chunks: Vec<std::ops::Range<usize>> =
            (0..n).map(|i| data.len() * i / n..data.len() * (i + 1) / n).collect();
        let mine = self.reduce_scatter(call, lane, data, &chunks);
        let (others, me) = self.others(call.group);
        for &peer in &others {
            self.send(call, peer, lane, &mine);
        }
        // Member i's chunk, in group order, without this rank's.
        let want: Vec<usize> = (0..n).filter(|&i| i != me).map(|i| chunks[i].len()).collect();
        let mut received = self.recv_all(call, &others, lane, &want).into_iter();
        let mut all = Vec::with_capacity(data.len());
        for &member in call.group {
            if member == self.rank {
                all.extend_from_slice(&mine);
            } else {
                all.extend(received.next().expect("a chunk"));
            }
        }
        all
    }
}

impl Tcp {
    /// Hands a started operation to the worker thread (created on first use), which runs it on
    /// its own lane.
    fn start<B: Backend>(&mut self, be: &mut B, sum: bool, input: View, output: View, group: &[usize]) {
        let mut data = vec![0f32; input.len];
        be.download_message(input, &mut data);
        let net = &self.net;
        let (jobs, _) = self.worker.get_or_insert_with(|| {
            let (jobs, inbox) = channel::<Started>();
            let (outbox, results) = channel();
            let net = net.clone();
            std::thread::spawn(move || {
                for (sum, data, view, group) in inbox {
                    let call =
                        Call { op: if sum { "all-reduce (started)" } else { "all-gather (started)" }, group: &group };
                    let out = if sum {
                        net.all_reduce(&call, Lane::Started, &data)
                    } else {
                        net.all_gather(&call, Lane::Started, &data)
                    };
                    if outbox.send((view, out)).is_err() {
                        break;
                    }
                }
            });
            (jobs, results)
        });
        jobs.send((sum, data, output, group.to_vec())).expect("the collectives worker is running");
        self.pending += 1;
    }

    fn download<B: Backend>(&mut self, be: &mut B, buf: View) -> Vec<f32> {
        let mut data = std::mem::take(&mut self.staging);
        data.resize(buf.len, 0.0);
        be.download(buf, &mut data);
        data
    }
}

impl<B: Backend> Collectives<B> for Tcp {
    fn rank(&self) -> usize {
        self.net.rank
    }

    fn set_step(&mut self, step: u64) {
        self.net.step.store(step, Ordering::Relaxed);
    }

    fn name_groups(&mut self, names: Vec<(Vec<usize>, String)>) {
        *self.net.names.lock().expect("names") = names;
    }

    fn bytes_sent(&self) -> Option<u64> {
        Some(self.net.sent.load(Ordering::Relaxed))
    }

    fn all_reduce_sum(&mut self, be: &mut B, buf: View, group: &[usize]) {
        let data = self.download(be, buf);
        let sum = self.net.all_reduce(&Call { op: "all-reduce", group }, Lane::Step, &data);
        be.upload(buf, &sum);
        self.staging = data;
    }

    fn all_reduce_max(&mut self, be: &mut B, buf: View, group: &[usize]) {
        // Small buffers (a maximum per row): every member's, gathered, then the maximum.
        let data = self.download(be, buf);
        let all = self.net.all_gather(&Call { op: "all-reduce (max)", group }, Lane::Step, &data);
        let parts: Vec<&[f32]> = all.chunks_exact(buf.len.max(1)).collect();
        be.upload(buf, &super::comm::max_of(&parts, buf.len));
        self.staging = data;
    }

    fn reduce_scatter_sum(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        assert_eq!(input.len, output.len * group.len(), "reduce-scatter sizes");
        let data = self.download(be, input);
        let parts: Vec<_> = (0..group.len()).map(|i| i * output.len..(i + 1) * output.len).collect();
        let mine = self.net.reduce_scatter(&Call { op: "reduce-scatter", group }, Lane::Step, &data, &parts);
        be.upload(output, &mine);
        self.staging = data;
    }

    fn all_gather(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        assert_eq!(output.len, input.len * group.len(), "all-gather sizes");
        let mut data = std::mem::take(&mut self.staging);
        data.resize(input.len, 0.0);
        be.download_message(input, &mut data);
        let all = self.net.all_gather(&Call { op: "all-gather", group }, Lane::Step, &data);
        be.upload_message(output, &all);
        self.staging = data;
    }

    fn all_reduce_sum_start(&mut self, be: &mut B, buf: View, group: &[usize]) {
        self.start(be, true, buf, buf, group);
    }

    fn all_gather_start(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        assert_eq!(output.len, input.len * group.len(), "all-gather sizes");
        self.start(be, false, input, output, group);
    }

    fn wait(&mut self, be: &mut B) {
        let Some((_, results)) = &self.worker else { return };
        for _ in 0..std::mem::take(&mut self.pending) {
            let (view, out) = results.recv().expect("the collectives worker is running");
            be.upload_message(view, &out);
        }
    }

    fn all_to_all(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        all_to_all_part(input, output, group);
        let data = self.download(be, input);
        let all = self.net.all_to_all(&Call { op: "all-to-all", group }, Lane::Step, &data);
        be.upload(output, &all);
        self.staging = data;
    }

    fn send_recv(&mut self, be: &mut B, sends: &[(View, usize)], recvs: &[(View, usize)]) {
        let mut data = Vec::new();
        for &(buf, to) in sends {
            data.resize(buf.len, 0.0);
            be.download(buf, &mut data);
            self.net.send(&Call { op: "pipeline send", group: &[self.net.rank, to] }, to, Lane::PointToPoint, &data);
        }
        for &(buf, from) in recvs {
            let call = Call { op: "pipeline receive", group: &[from, self.net.rank] };
            let got = self.net.recv_all(&call, &[from], Lane::PointToPoint, &[buf.len]).swap_remove(0);
            be.upload(buf, &got);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{BufKind, cpu::Cpu};
    use crate::parallel::comm::Virtual;

    /// What the test ranks agree on.
    const TERMS: &str = "engine = test\n";

    /// `n` ranks of one job, each on a thread, joined over loopback TCP.
    fn ranks(n: usize) -> Vec<Tcp> {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let job = Job {
                    rank,
                    world: n,
                    local_rank: rank,
                    local_world: n,
                    coordinator: format!("127.0.0.1:{port}"),
                    convention: "test",
                    token: "t".into(),
                };
                std::thread::spawn(move || {
                    Tcp::connect(&job, Duration::from_secs(30), Duration::from_secs(30), TERMS).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// What every collective gives on rank `rank` of `comm`, over data that makes order matter
    /// (values of very different magnitudes, lengths that do not divide evenly).
    fn exercise(rank: usize, comm: &mut dyn Collectives<Cpu>, be: &mut Cpu) -> Vec<Vec<f32>> {
        let world: Vec<usize> = (0..4).collect();
        let pairs = if rank.is_multiple_of(2) { vec![0, 2] } else { vec![1, 3] };
        let value = |i: usize| ((rank * 7919 + i * 104_729) % 1000) as f32 * 10f32.powi((i % 9) as i32 - 4);
        let mut out = Vec::new();
        let read = |be: &mut Cpu, v: View| {
            let mut host = vec![0f32; v.len];
            be.download(v, &mut host);
            host
        };
        for len in [1, 3, 13, 1000] {
            let buf = be.alloc(BufKind::Grads, len);
            be.upload(buf, &(0..len).map(value).collect::<Vec<_>>());
            comm.all_reduce_sum(be, buf, &world);
            out.push(read(be, buf));
            comm.all_reduce_sum(be, buf, &pairs);
            out.push(read(be, buf));
            be.upload(buf, &(0..len).map(|i| value(i) - value(i + 1)).collect::<Vec<_>>());
            comm.all_reduce_max(be, buf, &pairs);
            out.push(read(be, buf));
        }
        let (input, shard) = (be.alloc(BufKind::Grads, 12), be.alloc(BufKind::Grads, 3));
        be.upload(input, &(0..12).map(value).collect::<Vec<_>>());
        comm.reduce_scatter_sum(be, input, shard, &world);
        out.push(read(be, shard));
        let gathered = be.alloc(BufKind::Params, 12);
        comm.all_gather(be, shard, gathered, &world);
        out.push(read(be, gathered));
        // Started operations, with a synchronous one between.
        let (x, y, g) = (be.alloc(BufKind::Grads, 5), be.alloc(BufKind::Grads, 3), be.alloc(BufKind::Params, 6));
        be.upload(x, &(0..5).map(value).collect::<Vec<_>>());
        be.upload(y, &[rank as f32, 1.5, 1e-3]);
        comm.all_reduce_sum_start(be, x, &world);
        comm.all_gather_start(be, y, g, &pairs);
        comm.all_reduce_sum(be, gathered, &pairs);
        comm.wait(be);
        out.extend([read(be, x), read(be, g), read(be, gathered)]);
        // All-to-alls over the world (parts of 3) and over pairs (parts of 6).
        for group in [world.clone(), pairs.clone()] {
            let (input, output) = (be.alloc(BufKind::Activations, 12), be.alloc(BufKind::Activations, 12));
            be.upload(input, &(0..12).map(value).collect::<Vec<_>>());
            comm.all_to_all(be, input, output, &group);
            out.push(read(be, output));
        }
        // A ring of sends and receives, twice.
        let (send, recv) = (be.alloc(BufKind::Activations, 2), be.alloc(BufKind::Activations, 2));
        for round in 0..2 {
            be.upload(send, &[rank as f32, round as f32]);
            comm.send_recv(be, &[(send, (rank + 1) % 4)], &[(recv, (rank + 3) % 4)]);
            out.push(read(be, recv));
        }
        out
    }

    #[test]
    fn every_collective_gives_the_virtual_devices_bits() {
        let tcp: Vec<_> = ranks(4)
            .into_iter()
            .enumerate()
            .map(|(rank, mut comm)| std::thread::spawn(move || exercise(rank, &mut comm, &mut Cpu::new())))
            .collect();
        let virt: Vec<_> = Virtual::devices(4)
            .into_iter()
            .enumerate()
            .map(|(rank, mut comm)| std::thread::spawn(move || exercise(rank, &mut comm, &mut Cpu::new())))
            .collect();
        let bits =
            |v: Vec<Vec<f32>>| -> Vec<Vec<u32>> { v.iter().map(|x| x.iter().map(|f| f.to_bits()).collect()).collect() };
        for (rank, (t, v)) in tcp.into_iter().zip(virt).enumerate() {
            let (t, v) = (t.join().unwrap(), v.join().unwrap());
            assert_eq!(t[t.len() - 1], vec![((rank + 3) % 4) as f32, 1.0], "messages arrive in order");
            assert_eq!(bits(t), bits(v), "rank {rank}: TCP and virtual devices differ");
        }
    }

    /// A peer's first frames may travel in the same packet as its hello: none may be lost.
    #[test]
    fn what_follows_the_hello_is_kept() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        peer.write_all(b"ENGINE-TCP 1 t 1\nframes").unwrap();
        let (stream, _) = listener.accept().unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(hello_line(&stream), "ENGINE-TCP 1 t 1");
        let mut rest = [0u8; 6];
        (&stream).read_exact(&mut rest).unwrap();
        assert_eq!(&rest, b"frames");
    }

    #[test]
    fn strangers_and_other_jobs_are_turned_away() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let job = |rank: usize, token: &str| Job {
            rank,
            world: 2,
            local_rank: rank,
            local_world: 2,
            coordinator: format!("127.0.0.1:{port}"),
            convention: "test",
            token: token.into(),
        };
        let (zero, one) = (job(0, "mine"), job(1, "mine"));
        let coordinator =
            std::thread::spawn(move || Tcp::connect(&zero, Duration::from_secs(20), Duration::from_secs(5), TERMS));
        // A silent stranger, a talkative one, and a rank of another job come first.
        std::thread::sleep(Duration::from_millis(300));
        let _silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
        (&TcpStream::connect(("127.0.0.1", port)).unwrap()).write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let other = job(1, "theirs");
        let refused =
            rendezvous::meet(&other, Duration::from_secs(5), TERMS, |_| Ok("-".into()), Vec::new).err().unwrap();
        assert!(refused.to_string().contains("another job"), "{refused}");
        let mut rank1 = Tcp::connect(&one, Duration::from_secs(20), Duration::from_secs(5), TERMS).unwrap();
        let mut rank0 = coordinator.join().unwrap().unwrap();
        let t = std::thread::spawn(move || {
            let mut be = Cpu::new();
            let buf = be.alloc(BufKind::Grads, 1);
            be.upload(buf, &[1.0]);
            Collectives::<Cpu>::all_reduce_sum(&mut rank1, &mut be, buf, &[0, 1]);
            let mut v = [0f32];
            be.download(buf, &mut v);
            v[0]
        });
        let mut be = Cpu::new();
        let buf = be.alloc(BufKind::Grads, 1);
        be.upload(buf, &[2.0]);
        Collectives::<Cpu>::all_reduce_sum(&mut rank0, &mut be, buf, &[0, 1]);
        assert_eq!(t.join().unwrap(), 3.0);
    }

    /// Headers: the lanes, an abort, kinds no engine sends; a length is the sender's word, and
    /// a receive refuses any other than it expects, naming the peer, the lane and the length.
    #[test]
    fn frame_headers_and_unexpected_lengths() {
        let head = |kind: u8, len: u64| {
            let mut h = [kind; 9];
            h[1..].copy_from_slice(&len.to_le_bytes());
            h
        };
        assert_eq!(Header::parse(head(2, 7)), Ok(Header::Data { lane: Lane::PointToPoint, len: 7 }));
        assert_eq!(Header::parse(head(ABORT, 12)), Ok(Header::Abort { len: 12 }));
        assert!(Header::parse(head(ABORT, 1 << 40)).unwrap_err().contains("stop message of 1099511627776 bytes"));
        assert_eq!(Header::parse(head(7, 1)), Err("it sent a frame of unknown kind 7".into()));
        let frame = Header::Data { lane: Lane::Started, len: 1 << 61 };
        assert_eq!(Header::parse(frame.bytes()), Ok(frame));
        assert_eq!(unexpected(1, Lane::Step, 20544, 20544), None);
        let why = unexpected(1, Lane::Step, 1 << 61, 20544).unwrap();
        assert!(
            why.starts_with("rank 1 sent a frame of 2305843009213693952 elements on the step lane where 20544"),
            "{why}"
        );
    }

    /// A body is read as it arrives: a header that claims 2^40 or 2^61 elements over a stream
    /// that ends costs one part's memory, not the claim's (which would abort the process).
    #[test]
    fn a_body_is_read_as_it_arrives_not_as_its_header_claims() {
        let bytes: Vec<u8> = (0..10u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
        assert_eq!(read_body(&mut &bytes[..], 10).unwrap(), (0..10).map(|i| i as f32).collect::<Vec<_>>());
        for claim in [1u64 << 40, 1 << 61] {
            let e = read_body(&mut &bytes[..], claim).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        }
        let parts: Vec<u8> = (0..BODY_PART as u32 + 3).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let body = read_body(&mut &parts[..], BODY_PART as u64 + 3).unwrap();
        assert_eq!((body.len(), body[BODY_PART + 2]), (BODY_PART + 3, (BODY_PART + 2) as f32));
    }

    /// The fuzz target's seeds (fuzz/seeds/tcp_frame) read as a reader reads a connection:
    /// headers claiming 2^61 and 2^40 elements end their stream at its end, without the claim's
    /// memory; a stream of whole frames reads back frame by frame.
    #[test]
    fn the_fuzz_seeds_read_frame_by_frame() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/seeds/tcp_frame");
        let read = |name: &str| {
            let bytes = std::fs::read(format!("{dir}/{name}")).unwrap();
            let (mut stream, mut frames, mut claims) = (&bytes[..], Vec::new(), Vec::new());
            let end = loop {
                match next_frame(&mut stream, |lane, len| claims.push((lane, len))) {
                    Ok(frame) => frames.push(frame),
                    Err(why) => break why,
                }
            };
            (frames, claims, end)
        };
        for (name, lane, len) in [("elements_2_61", Lane::Step, 1 << 61), ("elements_2_40", Lane::Started, 1 << 40)] {
            let (frames, claims, end) = read(name);
            assert_eq!((frames, claims), (vec![], vec![(lane, len)]), "{name}");
            assert!(end.contains("in the middle of a message"), "{name}: {end}");
        }
        let (frames, _, end) = read("frames");
        assert_eq!(frames.len(), 4, "{frames:?}");
        assert_eq!(frames[0], Frame::Data { lane: Lane::Step, body: vec![1.5, -2.0, 1e-3] });
        assert_eq!(frames[2], Frame::Data { lane: Lane::PointToPoint, body: vec![] });
        assert!(matches!(&frames[3], Frame::Abort(text) if text.ends_with("rank 1 left the job")));
        assert_eq!(end, "it closed its connection (the process ended)");
    }

    /// A connection to a rank's mesh listener that says nothing does not hold up the mesh: its
    /// hello is read on a thread of its own (it used to hold the accepting loop for 10 s).
    #[test]
    fn a_silent_connection_does_not_delay_the_mesh() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let job =
            |rank| Job { rank, world: 2, coordinator: format!("127.0.0.1:{port}"), token: "t".into(), ..Job::single() };
        let zero = job(0);
        let rank0 =
            std::thread::spawn(move || Tcp::connect(&zero, Duration::from_secs(20), Duration::from_secs(5), TERMS));
        // Rank 1 by hand: it learns rank 0's listener at the rendezvous, and a stranger that
        // says nothing connects to it first.
        let meeting = rendezvous::meet(&job(1), Duration::from_secs(20), TERMS, |_| Ok("-".into()), Vec::new).unwrap();
        let _silent = TcpStream::connect(&meeting.brought[0]).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let start = Instant::now();
        let rank1 = TcpStream::connect(&meeting.brought[0]).unwrap();
        (&rank1).write_all(format!("{HELLO} t 1\n").as_bytes()).unwrap();
        rank0.join().unwrap().unwrap();
        assert!(start.elapsed() < Duration::from_secs(5), "the mesh took {:?}", start.elapsed());
    }
}
