//! NCCL collectives for GPUs: one process per GPU, communicators from a unique id that rank 0
//! creates and the rendezvous hands to every rank ([`crate::parallel::rendezvous`]).
//!
//! NCCL is loaded at run time (cudarc's dynamic loading, `libnccl.so.2`), like the other CUDA
//! libraries. Every operation runs on a second stream of its own, in place on the backend's
//! buffers (no host round trip), ordered with the kernels by events: the communication stream
//! waits for the compute stream's work issued before the operation; the compute stream waits
//! for the operation right away (a synchronous collective) or at [`Collectives::wait`] (one
//! started ahead: FSDP's prefetched gathers and the gradient buckets, which thus overlap the
//! kernels issued meanwhile). One stream for every operation keeps them in issue order, as NCCL
//! needs for operations on one communicator. A group of the mesh (one axis's ranks)
//! gets its own communicator, split from the world's the first time the group is used; every
//! rank reaches that first use at the same point of the step (the passes are the same on every
//! rank), which is what `ncclCommSplit`, a collective call, requires.
//!
//! **The watchdog.** NCCL's collectives have no deadline of their own: a lost or stopped rank
//! leaves the others waiting forever in the kernel. Every operation is followed by an event on
//! the communication stream; a thread of its own ([`Watchdog`]) checks the oldest event still
//! pending and every communicator's asynchronous error (`ncclCommGetAsyncError`) a few times a
//! second. An operation pending for `ENGINE_COLLECTIVE_TIMEOUT` seconds, or an asynchronous
//! error (NCCL's remote-error detection of a peer that left), prints one line naming the
//! collective, the axis, the step and the cause, aborts every communicator (`ncclCommAbort`)
//! and exits with [`COLLECTIVE_FAILED`], as the TCP collectives do.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use cudarc::driver::{result as cu, sys as driver};
use cudarc::nccl::{result, sys};

use super::COLLECTIVE_FAILED;
use super::comm::{Collectives, all_to_all_part};
use crate::backend::View;
use crate::backend::cuda::Cuda;
use crate::backend::traced::Traced;

/// A process's NCCL communicators.
pub struct Nccl {
    rank: usize,
    world: sys::ncclComm_t,
    size: usize,
    groups: HashMap<Vec<usize>, sys::ncclComm_t>,
    /// The communication stream, created on first use (the backend's context is current then).
    side: Option<Side>,
    /// What the watchdog thread watches.
    watched: Arc<Watched>,
}

/// What the watchdog of one process sees: the communicators, the operations in flight and
/// the names of the groups, for its message.
struct Watched {
    state: Mutex<WatchState>,
    step: AtomicU64,
    timeout: Duration,
}

#[derive(Default)]
struct WatchState {
    /// Every communicator (as addresses: the thread only reads their errors and aborts them).
    comms: Vec<usize>,
    /// Operations issued and not seen complete: the event recorded after each, when it was
    /// issued, what it is.
    inflight: VecDeque<(usize, Instant, String)>,
    /// The CUDA context the events belong to (as an address).
    context: usize,
    names: Vec<(Vec<usize>, String)>,
}

/// The watchdog's thread: started with the communicator, it ends with the process.
struct Watchdog;

impl Watchdog {
    fn start(rank: usize, watched: Arc<Watched>) {
        std::thread::Builder::new()
            .name("nccl-watchdog".into())
            .spawn(move || {
                let mut current = 0usize;
                loop {
                    std::thread::sleep(Duration::from_millis(250));
                    if let Some(cause) = Watchdog::check(&watched, &mut current) {
                        Watchdog::fail(rank, &watched, &cause);
                    }
                }
            })
            .expect("starting the NCCL watchdog");
    }

    /// The first failure seen, if any: an asynchronous error, or the oldest pending operation
    /// past the deadline. Completed operations are dropped.
    fn check(watched: &Watched, current: &mut usize) -> Option<String> {
        let mut state = watched.state.lock().ok()?;
        for &comm in &state.comms {
            let mut error = sys::ncclResult_t::ncclSuccess;
            // SAFETY: a live communicator (they are destroyed with the process); the call is
            // thread-safe by NCCL's documentation.
            unsafe { sys::ncclCommGetAsyncError(comm as sys::ncclComm_t, &mut error) };
            if !matches!(error, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress) {
                let what = state.inflight.front().map_or("a collective", |(_, _, what)| what.as_str()).to_owned();
                return Some(format!("{what}: NCCL reports {error:?} (a peer left, or its network failed)"));
            }
        }
        if state.context != *current && state.context != 0 {
            // SAFETY: the backend's context, alive for the process.
            unsafe { cu::ctx::set_current(state.context as driver::CUcontext) }.ok()?;
            *current = state.context;
        }
        while let Some(&(event, issued, _)) = state.inflight.front() {
            // SAFETY: an event this process created and has not destroyed.
            match unsafe { driver::cuEventQuery(event as driver::CUevent) } {
                driver::CUresult::CUDA_SUCCESS => {
                    // SAFETY: as above, destroyed once.
                    let _ = unsafe { cu::event::destroy(event as driver::CUevent) };
                    state.inflight.pop_front();
                }
                driver::CUresult::CUDA_ERROR_NOT_READY if issued.elapsed() < watched.timeout => break,
                driver::CUresult::CUDA_ERROR_NOT_READY => {
                    let what = &state.inflight.front().expect("pending").2;
                    return Some(format!(
                        "{what}: not complete after {:.0} s (ENGINE_COLLECTIVE_TIMEOUT): a rank is stopped, stuck, lost, or far behind",
                        watched.timeout.as_secs_f64()
                    ));
                }
                other => return Some(format!("the GPU failed while a collective ran: {other:?}")),
            }
        }
        None
    }

    fn fail(rank: usize, watched: &Watched, cause: &str) -> ! {
        let step = watched.step.load(Ordering::Relaxed);
        let at = if step == 0 { "before the first step".to_owned() } else { format!("at step {step}") };
        crate::say!("error: rank {rank}: {cause} ({at}); aborting the NCCL communicators");
        // Which collective each rank was in: the flight recorder's ranks.
        super::flight::on_failure(&format!("rank {rank}: {cause} ({at})"), &[]);
        if let Ok(state) = watched.state.lock() {
            for &comm in &state.comms {
                // SAFETY: a live communicator; aborting from another thread is how NCCL
                // releases a rank blocked in a collective.
                unsafe { sys::ncclCommAbort(comm as sys::ncclComm_t) };
            }
        }
        std::process::exit(COLLECTIVE_FAILED);
    }
}

/// The communication stream and its events.
struct Side {
    stream: driver::CUstream,
    /// Recorded on the compute stream before each operation; the communication stream waits
    /// for it.
    issued: driver::CUevent,
    /// Recorded on the communication stream; the compute stream waits for it.
    done: driver::CUevent,
    /// Whether operations were started and not yet waited for.
    started: bool,
    /// Outputs of started gathers, whose bf16 copies are refreshed at the wait.
    gathered: Vec<View>,
}

// SAFETY: communicators are used by one thread at a time (the trainer's), as NCCL requires;
// moving them to another thread between uses is allowed.
unsafe impl Send for Nccl {}

/// A new NCCL unique id (rank 0 creates it; the rendezvous hands it to the others).
pub fn unique_id() -> Result<Vec<u8>> {
    let id = result::get_uniqueid()
        .map_err(|e| anyhow!("NCCL: cannot create a unique id: {e:?} (is libnccl.so.2 installed?)"))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

impl Nccl {
    /// Joins the job's world communicator as `rank` of `size`, on the GPU current on this
    /// thread (the backend's), with the id rank 0 created; the watchdog allows each operation
    /// `timeout`.
    pub fn init(id: &[u8], rank: usize, size: usize, timeout: Duration) -> Result<Nccl> {
        let mut unique = sys::ncclUniqueId { internal: [0; 128] };
        if id.len() != unique.internal.len() {
            bail!("NCCL: the unique id from rank 0 has {} bytes, {} expected", id.len(), unique.internal.len());
        }
        for (dst, &src) in unique.internal.iter_mut().zip(id) {
            *dst = src as _;
        }
        let mut world = std::ptr::null_mut();
        // SAFETY: a valid out pointer and id; collective over the `size` ranks of the job.
        unsafe { result::comm_init_rank(&mut world, size as i32, unique, rank as i32) }
            .map_err(|e| anyhow!("NCCL: rank {rank} of {size} cannot join the job: {e:?}"))?;
        let watched = Arc::new(Watched {
            state: Mutex::new(WatchState { comms: vec![world as usize], ..WatchState::default() }),
            step: AtomicU64::new(0),
            timeout,
        });
        Watchdog::start(rank, watched.clone());
        Ok(Nccl { rank, world, size, groups: HashMap::new(), side: None, watched })
    }

    /// The communicator of `group`: the world's, or one split from it on first use.
    fn comm(&mut self, group: &[usize]) -> sys::ncclComm_t {
        if group.len() == self.size {
            return self.world;
        }
        if let Some(&c) = self.groups.get(group) {
            return c;
        }
        // Groups of one axis partition the ranks; the first member names the part.
        let (color, key) = (group[0] as i32, group.iter().position(|&r| r == self.rank).expect("member") as i32);
        let mut comm = std::ptr::null_mut();
        // SAFETY: valid communicator and out pointer; every rank of the world splits here.
        unsafe { sys::ncclCommSplit(self.world, color, key, &mut comm, std::ptr::null_mut()) }
            .result()
            .unwrap_or_else(|e| panic!("NCCL: cannot create the communicator of group {group:?}: {e:?}"));
        self.groups.insert(group.to_vec(), comm);
        self.watched.state.lock().expect("watchdog state").comms.push(comm as usize);
        comm
    }

    /// Hands the operation just issued on the communication stream to the watchdog.
    fn watch(&mut self, op: &str, group: &[usize]) {
        let Some(side) = &self.side else { return };
        let flags = driver::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        let event = stream_check("creating an event", cu::event::create(flags));
        // SAFETY: a live event and stream of this context.
        stream_check("recording", unsafe { cu::event::record(event, side.stream) });
        let mut state = self.watched.state.lock().expect("watchdog state");
        if state.context == 0 {
            // SAFETY: reads the calling thread's current context (the backend's).
            let mut ctx = std::ptr::null_mut();
            unsafe { driver::cuCtxGetCurrent(&mut ctx) };
            state.context = ctx as usize;
        }
        let axis = match state.names.iter().find(|(g, _)| g == group) {
            Some((_, name)) => format!("the {name} axis (ranks {group:?})"),
            None => format!("ranks {group:?}"),
        };
        state.inflight.push_back((event as usize, Instant::now(), format!("{op} over {axis}")));
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // The watchdog stops watching before the communicators and events go.
        if let Ok(mut state) = self.watched.state.lock() {
            state.comms.clear();
            for (event, _, _) in state.inflight.drain(..) {
                // SAFETY: an event this process created, destroyed once.
                let _ = unsafe { cu::event::destroy(event as driver::CUevent) };
            }
        }
        for comm in self.groups.values().copied().chain([self.world]) {
            // SAFETY: communicators this struct created, destroyed once.
            let _ = unsafe { result::comm_destroy(comm) };
        }
        if let Some(side) = self.side.take() {
            // SAFETY: created by `Nccl::begin`, destroyed once, after the communicators' work.
            unsafe {
                let _ = cu::stream::synchronize(side.stream);
                let _ = cu::event::destroy(side.issued);
                let _ = cu::event::destroy(side.done);
                let _ = cu::stream::destroy(side.stream);
            }
        }
    }
}

/// A failed stream or event call: the device is unusable, nothing sensible can follow.
fn stream_check<T>(what: &str, r: std::result::Result<T, cudarc::driver::DriverError>) -> T {
    r.unwrap_or_else(|e| panic!("CUDA: {what} failed for the NCCL communication stream: {e}"))
}

impl Nccl {
    /// Orders the next operation after the compute stream's work so far and returns the
    /// communication stream to issue it on.
    fn begin(&mut self, be: &Cuda) -> sys::cudaStream_t {
        let compute = compute_stream(be);
        let side = self.side.get_or_insert_with(|| {
            let flags = driver::CUevent_flags::CU_EVENT_DISABLE_TIMING;
            Side {
                stream: stream_check("creating", cu::stream::create(cu::stream::StreamKind::NonBlocking)),
                issued: stream_check("creating an event", cu::event::create(flags)),
                done: stream_check("creating an event", cu::event::create(flags)),
                started: false,
                gathered: Vec::new(),
            }
        });
        // SAFETY: live stream and events of this context.
        unsafe {
            stream_check("recording", cu::event::record(side.issued, compute));
            let wait = driver::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT;
            stream_check("waiting", cu::stream::wait_event(side.stream, side.issued, wait));
        }
        side.stream as sys::cudaStream_t
    }

    /// Makes the compute stream wait for every operation issued so far.
    fn join(&mut self, be: &Cuda) {
        let Some(side) = &mut self.side else { return };
        let compute = compute_stream(be);
        // SAFETY: live stream and events of this context.
        unsafe {
            stream_check("recording", cu::event::record(side.done, side.stream));
            let wait = driver::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT;
            stream_check("waiting", cu::stream::wait_event(compute, side.done, wait));
        }
    }

    fn all_reduce(&mut self, be: &mut Cuda, buf: View, group: &[usize], op: sys::ncclRedOp_t) {
        let comm = self.comm(group);
        let (ptr, dtype) = target(be, buf);
        let stream = self.begin(be);
        // SAFETY: in place on a live device buffer of `buf.len` elements, ordered by events.
        check("all-reduce", unsafe { result::all_reduce(ptr, ptr, buf.len, dtype, op, comm, stream) });
        self.watch("all-reduce", group);
    }

    fn all_gather_on_side(&mut self, be: &mut Cuda, input: View, output: View, group: &[usize]) {
        assert_eq!(output.len, input.len * group.len(), "all-gather sizes");
        let comm = self.comm(group);
        // Into bf16 (FSDP's gathered parameters), the pieces' bf16 copies travel: 2 bytes an
        // element, the values the ops would read from the pieces themselves.
        let (dst, u) = target(be, output);
        let (src, t) =
            if u == sys::ncclDataType_t::ncclBfloat16 { compute_target(be, input) } else { target(be, input) };
        assert!(t == u, "internal error: all-gather between element types");
        let stream = self.begin(be);
        // SAFETY: live device buffers of the asserted sizes, ordered by events.
        check("all-gather", unsafe { result::all_gather(src, dst, input.len, t, comm, stream) });
        self.watch("all-gather", group);
    }
}

/// Address and NCCL type of a view.
fn target(be: &Cuda, v: View) -> (*mut c_void, sys::ncclDataType_t) {
    typed(be.raw_view(v))
}

/// Address and NCCL type of what the ops read from a view (parameters: their bf16 copy).
fn compute_target(be: &Cuda, v: View) -> (*mut c_void, sys::ncclDataType_t) {
    typed(be.compute_view(v))
}

fn typed((ptr, size): (driver::CUdeviceptr, usize)) -> (*mut c_void, sys::ncclDataType_t) {
    let dtype = match size {
        4 => sys::ncclDataType_t::ncclFloat32,
        2 => sys::ncclDataType_t::ncclBfloat16,
        // FP8 casts travel as bytes (a gather moves them; nothing adds them up).
        _ => sys::ncclDataType_t::ncclUint8,
    };
    (ptr as *mut c_void, dtype)
}

/// The backend's compute stream, which the communication stream is ordered with.
fn compute_stream(be: &Cuda) -> driver::CUstream {
    be.compute_stream().expect("NCCL needs a GPU, not the emulator")
}

fn check(op: &str, r: std::result::Result<result::NcclStatus, result::NcclError>) {
    // A failed collective leaves the ranks out of step: nothing sensible can follow.
    if let Err(e) = r {
        panic!("NCCL {op} failed: {e:?}");
    }
}

impl Collectives<Cuda> for Nccl {
    fn rank(&self) -> usize {
        self.rank
    }

    fn set_step(&mut self, step: u64) {
        self.watched.step.store(step, Ordering::Relaxed);
    }

    fn name_groups(&mut self, names: Vec<(Vec<usize>, String)>) {
        self.watched.state.lock().expect("watchdog state").names = names;
    }

    fn all_reduce_sum(&mut self, be: &mut Cuda, buf: View, group: &[usize]) {
        self.all_reduce(be, buf, group, sys::ncclRedOp_t::ncclSum);
        self.join(be);
        be.written(buf);
    }

    fn all_reduce_max(&mut self, be: &mut Cuda, buf: View, group: &[usize]) {
        self.all_reduce(be, buf, group, sys::ncclRedOp_t::ncclMax);
        self.join(be);
        be.written(buf);
    }

    fn reduce_scatter_sum(&mut self, be: &mut Cuda, input: View, output: View, group: &[usize]) {
        assert_eq!(input.len, output.len * group.len(), "reduce-scatter sizes");
        let comm = self.comm(group);
        let ((src, t), (dst, u)) = (target(be, input), target(be, output));
        assert!(t == u, "internal error: reduce-scatter between element types");
        let stream = self.begin(be);
        // SAFETY: live device buffers of the asserted sizes (the output may be the input's own
        // part, NCCL's in-place form), ordered by events.
        check("reduce-scatter", unsafe {
            result::reduce_scatter(src, dst, output.len, t, sys::ncclRedOp_t::ncclSum, comm, stream)
        });
        self.watch("reduce-scatter", group);
        self.join(be);
        be.written(output);
    }

    fn all_gather(&mut self, be: &mut Cuda, input: View, output: View, group: &[usize]) {
        self.all_gather_on_side(be, input, output, group);
        self.join(be);
        be.written(output);
    }

    fn all_reduce_sum_start(&mut self, be: &mut Cuda, buf: View, group: &[usize]) {
        self.all_reduce(be, buf, group, sys::ncclRedOp_t::ncclSum);
        self.side.as_mut().expect("begun").started = true;
    }

    fn all_gather_start(&mut self, be: &mut Cuda, input: View, output: View, group: &[usize]) {
        self.all_gather_on_side(be, input, output, group);
        let side = self.side.as_mut().expect("begun");
        side.started = true;
        side.gathered.push(output);
    }

    fn send_recv(&mut self, be: &mut Cuda, sends: &[(View, usize)], recvs: &[(View, usize)]) {
        if sends.is_empty() && recvs.is_empty() {
            return;
        }
        // Peers are global ranks on the world's communicator. One group, so that neighbours
        // sending to each other at once (1F1B) do not wait for each other's receive.
        let world = self.world;
        let stream = self.begin(be);
        check("group start", result::group_start());
        for &(buf, to) in sends {
            let (ptr, dtype) = target(be, buf);
            // SAFETY: a live device buffer of `buf.len` elements, ordered by events.
            check("send", unsafe { result::send(ptr, buf.len, dtype, to as i32, world, stream) });
        }
        for &(buf, from) in recvs {
            let (ptr, dtype) = target(be, buf);
            // SAFETY: as above; nothing reads `buf` before the join below.
            check("recv", unsafe { result::recv(ptr, buf.len, dtype, from as i32, world, stream) });
        }
        check("group end", result::group_end());
        let peers: Vec<usize> = sends.iter().chain(recvs).map(|&(_, r)| r).chain([self.rank]).collect();
        self.watch("pipeline send/receive", &peers);
        self.join(be);
        for &(buf, _) in recvs {
            be.written(buf);
        }
    }

    fn all_to_all(&mut self, be: &mut Cuda, input: View, output: View, group: &[usize]) {
        let part = all_to_all_part(input, output, group);
        let comm = self.comm(group);
        let ((src, t), (dst, u)) = (target(be, input), target(be, output));
        assert!(t == u, "internal error: all-to-all between element types");
        let width = if t == sys::ncclDataType_t::ncclBfloat16 { 2 } else { 4 };
        // One part to and from every member (peers are positions in the group's communicator),
        // in one group call: fixed sizes, no count read back.
        let stream = self.begin(be);
        check("group start", result::group_start());
        for peer in 0..group.len() {
            // SAFETY: parts within the live buffers, as checked above; ordered by events.
            unsafe {
                let at = peer * part * width;
                let (s, d) = ((src as *mut u8).add(at), (dst as *mut u8).add(at));
                check("send", result::send(s as *const c_void, part, t, peer as i32, comm, stream));
                check("recv", result::recv(d as *mut c_void, part, t, peer as i32, comm, stream));
            }
        }
        check("group end", result::group_end());
        self.watch("all-to-all", group);
        self.join(be);
        be.written(output);
    }

    fn wait(&mut self, be: &mut Cuda) {
        let Some(side) = self.side.as_mut().filter(|s| s.started) else { return };
        side.started = false;
        let gathered = std::mem::take(&mut side.gathered);
        self.join(be);
        for v in gathered {
            be.written(v);
        }
    }
}

/// The same on a traced backend (the trainer's); collectives are not traced spans.
impl Collectives<Traced<Cuda>> for Nccl {
    fn rank(&self) -> usize {
        self.rank
    }

    fn set_step(&mut self, step: u64) {
        Collectives::<Cuda>::set_step(self, step)
    }

    fn name_groups(&mut self, names: Vec<(Vec<usize>, String)>) {
        Collectives::<Cuda>::name_groups(self, names)
    }

    fn all_reduce_sum(&mut self, be: &mut Traced<Cuda>, buf: View, group: &[usize]) {
        Collectives::<Cuda>::all_reduce_sum(self, &mut be.inner, buf, group)
    }

    fn all_reduce_max(&mut self, be: &mut Traced<Cuda>, buf: View, group: &[usize]) {
        Collectives::<Cuda>::all_reduce_max(self, &mut be.inner, buf, group)
    }

    fn reduce_scatter_sum(&mut self, be: &mut Traced<Cuda>, input: View, output: View, group: &[usize]) {
        Collectives::<Cuda>::reduce_scatter_sum(self, &mut be.inner, input, output, group)
    }

    fn all_gather(&mut self, be: &mut Traced<Cuda>, input: View, output: View, group: &[usize]) {
        Collectives::<Cuda>::all_gather(self, &mut be.inner, input, output, group)
    }

    fn all_reduce_sum_start(&mut self, be: &mut Traced<Cuda>, buf: View, group: &[usize]) {
        Collectives::<Cuda>::all_reduce_sum_start(self, &mut be.inner, buf, group)
    }

    fn all_gather_start(&mut self, be: &mut Traced<Cuda>, input: View, output: View, group: &[usize]) {
        Collectives::<Cuda>::all_gather_start(self, &mut be.inner, input, output, group)
    }

    fn all_to_all(&mut self, be: &mut Traced<Cuda>, input: View, output: View, group: &[usize]) {
        Collectives::<Cuda>::all_to_all(self, &mut be.inner, input, output, group)
    }

    fn wait(&mut self, be: &mut Traced<Cuda>) {
        Collectives::<Cuda>::wait(self, &mut be.inner)
    }

    fn send_recv(&mut self, be: &mut Traced<Cuda>, sends: &[(View, usize)], recvs: &[(View, usize)]) {
        Collectives::<Cuda>::send_recv(self, &mut be.inner, sends, recvs)
    }
}
