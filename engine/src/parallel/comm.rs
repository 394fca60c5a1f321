//! Collectives: the operations devices use to combine their work.
//!
//! One interface, [`Collectives`], over backend buffers. Groups are the ranks of one mesh axis
//! ([`crate::parallel::mesh::Mesh::group`]), listed in axis order; every member calls the same
//! operation with buffers of the same size. Three implementations: NCCL for GPUs (one process per
//! GPU), [`Virtual`] for CPU devices running as threads of one process, so that every
//! sharding path runs without GPUs, and [`Solo`] for a device alone. Sums are added in group order, so results are deterministic.

use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Barrier, Condvar, Mutex};

use crate::backend::{Backend, View};

/// Collective operations of one device.
pub trait Collectives<B: Backend> {
    /// This device's global rank.
    fn rank(&self) -> usize;
    /// The optimizer step in progress, for the messages of a collective that fails.
    fn set_step(&mut self, _step: u64) {}
    /// The mesh's names for its groups (`fsdp`, `tensor`, ...), for the same messages.
    fn name_groups(&mut self, _names: Vec<(Vec<usize>, String)>) {}
    /// Bytes this device has sent to others so far, where they travel over a network that
    /// counts them (the TCP collectives).
    fn bytes_sent(&self) -> Option<u64> {
        None
    }
    /// Time this device has spent waiting in collective calls so far (those that block, and
    /// the waits for started ones), where a wrapper counts it
    /// ([`super::flight::Flight`]): the straggler detector's "busy" time is a step's time less it.
    fn blocked(&self) -> Option<std::time::Duration> {
        None
    }
    /// Time a wrapper ([`super::flight::Flight`]) has spent on its own work so far (recording
    /// each operation, timing it), beside the operations themselves: what the flight recorder
    /// and the straggler detector cost.
    fn overhead(&self) -> Option<std::time::Duration> {
        None
    }
    /// `buf = Σ_group buf`, in place.
    fn all_reduce_sum(&mut self, be: &mut B, buf: View, group: &[usize]);
    /// `buf = max_group buf`, element by element, in place (f32 buffers: the vocabulary-parallel
    /// loss's row maxima).
    fn all_reduce_max(&mut self, be: &mut B, buf: View, group: &[usize]);
    /// `output = (Σ_group input)[shard]`: the member at position i of the group receives the i-th
    /// of `group.len()` equal parts of the sum (`input.len = output.len · group.len()`).
    fn reduce_scatter_sum(&mut self, be: &mut B, input: View, output: View, group: &[usize]);
    /// `output = concat_group(input)`, members in group order (`output.len = input.len ·
    /// group.len()`).
    fn all_gather(&mut self, be: &mut B, input: View, output: View, group: &[usize]);
    /// Starts `buf = Σ_group buf` and returns at once: the sum runs while the caller goes on
    /// computing (gradient buckets during the backward pass). `buf` must not be touched until
    /// [`Collectives::wait`]. Started operations complete in the order they were started.
    fn all_reduce_sum_start(&mut self, be: &mut B, buf: View, group: &[usize]) {
        self.all_reduce_sum(be, buf, group);
    }
    /// Starts `output = concat_group(input)` and returns at once, like
    /// [`Collectives::all_reduce_sum_start`]: FSDP gathers the next unit's parameters while the
    /// current unit computes. Neither buffer may be touched until [`Collectives::wait`].
    fn all_gather_start(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        self.all_gather(be, input, output, group);
    }
    /// Waits for every started operation; their results are then in their buffers.
    fn wait(&mut self, _be: &mut B) {}
    /// Point-to-point, between pipeline neighbours: sends each `(buffer, rank)` of `sends` and
    /// receives into each `(buffer, rank)` of `recvs`, as one group (NCCL's
    /// `ncclGroupStart`/`End`), so that two neighbours sending to each other at the same time
    /// (1F1B's steady state) do not wait on each other. Messages between two ranks arrive in
    /// the order they were sent. A send may wait for its receive (NCCL) or not (mailboxes, TCP
    /// with a reader thread per peer): the pipeline's order of groups is deadlock-free either
    /// way ([`crate::parallel::pipeline::handoffs`]).
    fn send_recv(&mut self, be: &mut B, sends: &[(View, usize)], recvs: &[(View, usize)]);
    /// All-to-all with variable counts, dropless (the expert axis's token exchange, as
    /// Megatron-Core's all-to-all dispatcher and MaxText's ragged all-to-all): `input` holds, one
    /// after the other in group order, the part this member sends to each member (`send[j]`
    /// elements to member j, its own part included; `input.len ≥ Σ send`). The counts travel
    /// first, so that each member learns what comes to it; then `output` receives, one after
    /// the other in group order, the part each member sent to this one. Returns those counts
    /// (`recv[j]` elements from member j). `output.len ≥ Σ recv`: the caller sizes it for the
    /// worst case (every member sends all it has here); elements past `Σ recv` are left as
    /// they were. Parts are copied, never added, so every implementation gives the same bits.
    fn all_to_all(&mut self, be: &mut B, input: View, send: &[usize], output: View, group: &[usize]) -> Vec<usize>;
}

/// Where parts laid one after the other start: `[0, c₀, c₀ + c₁, …, Σ c]`.
pub(crate) fn starts(counts: &[usize]) -> Vec<usize> {
    let mut at = vec![0];
    for &c in counts {
        at.push(at.last().expect("one") + c);
    }
    at
}

/// A count as an element of the f32 messages that collectives move (its `u32` bits, exact for
/// any count a buffer can hold), and back.
pub(crate) fn count_to_f32(count: usize) -> f32 {
    f32::from_bits(u32::try_from(count).expect("internal error: an all-to-all part of 2^32 elements or more"))
}

/// The count an element made by [`count_to_f32`] carries.
pub(crate) fn f32_to_count(x: f32) -> usize {
    x.to_bits() as usize
}

/// Checks an all-to-all's arguments before anything travels (internal errors: the callers size
/// the buffers).
pub(crate) fn check_all_to_all(input: View, send: &[usize], group: &[usize]) {
    assert_eq!(
        send.len(),
        group.len(),
        "internal error: all-to-all counts for {} members, group of {}",
        send.len(),
        group.len()
    );
    let total: usize = send.iter().sum();
    assert!(total <= input.len, "internal error: all-to-all sends {total} elements from a buffer of {}", input.len);
}

/// Checks that what arrives fits the output.
pub(crate) fn check_received(recv: &[usize], output: View, rank: usize) {
    let total: usize = recv.iter().sum();
    assert!(
        total <= output.len,
        "internal error: rank {rank} receives {total} elements in an all-to-all, its buffer holds {}",
        output.len
    );
}

/// A device alone (a mesh of one): every group is this device, so sums and gathers leave the data
/// as it is. Single-device training is the parallel path with this communicator.
pub struct Solo;

impl<B: Backend> Collectives<B> for Solo {
    fn rank(&self) -> usize {
        0
    }

    fn all_reduce_sum(&mut self, _be: &mut B, _buf: View, group: &[usize]) {
        debug_assert_eq!(group, [0], "a device alone has no peers");
    }

    fn all_reduce_max(&mut self, _be: &mut B, _buf: View, group: &[usize]) {
        debug_assert_eq!(group, [0], "a device alone has no peers");
    }

    fn reduce_scatter_sum(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        debug_assert_eq!(group, [0], "a device alone has no peers");
        be.copy(output, input);
    }

    fn all_gather(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        debug_assert_eq!(group, [0], "a device alone has no peers");
        be.copy(output, input);
    }

    fn send_recv(&mut self, _be: &mut B, sends: &[(View, usize)], recvs: &[(View, usize)]) {
        assert!(sends.is_empty() && recvs.is_empty(), "internal error: a device alone has no pipeline neighbours");
    }

    fn all_to_all(&mut self, be: &mut B, input: View, send: &[usize], output: View, group: &[usize]) -> Vec<usize> {
        debug_assert_eq!(group, [0], "a device alone has no peers");
        check_all_to_all(input, send, group);
        check_received(send, output, 0);
        if send[0] > 0 {
            be.copy(output.at(0, send[0]), input.at(0, send[0]));
        }
        send.to_vec()
    }
}

/// Devices of one process meeting in shared memory: create one [`Virtual`] per device with
/// [`Virtual::devices`] and move each to its own thread.
pub struct Virtual {
    rank: usize,
    shared: Arc<Shared>,
    staging: Vec<f32>,
    /// The second lane, where started operations run on a thread of their own.
    lane: Lane,
}

/// Operations started and not yet waited for. A worker thread meets the other devices'
/// workers over slots and barriers of its own (never mixing with the operations its device runs
/// meanwhile) and sends each sum back.
struct Lane {
    shared: Arc<Shared>,
    worker: Option<Worker>,
    pending: usize,
}

/// A started operation: what it does, the buffer its result goes to, this device's data, the
/// group.
type Started = (Op, View, Vec<f32>, Vec<usize>);

/// What a started operation does with the group's data.
#[derive(Clone, Copy)]
enum Op {
    Sum,
    Gather,
}
/// Where started operations go, and where their sums come back from.
type Worker = (Sender<Started>, Receiver<(View, Vec<f32>)>);

/// Point-to-point messages by (sender, receiver), oldest first.
type Mailboxes = HashMap<(usize, usize), VecDeque<Vec<f32>>>;

struct Shared {
    /// Each device's contribution to the collective in progress.
    slots: Vec<Mutex<Vec<f32>>>,
    /// One barrier per group, created on first use.
    barriers: Mutex<HashMap<Vec<usize>, Arc<Barrier>>>,
    /// Point-to-point messages sent and not yet received, by (sender, receiver), in order.
    mail: Mutex<Mailboxes>,
    /// Signalled whenever a message is posted.
    posted: Condvar,
}

impl Virtual {
    /// Handles for `n` virtual devices, ranks `0..n`.
    pub fn devices(n: usize) -> Vec<Virtual> {
        let new = || {
            Arc::new(Shared {
                slots: (0..n).map(|_| Mutex::new(Vec::new())).collect(),
                barriers: Mutex::new(HashMap::new()),
                mail: Mutex::new(HashMap::new()),
                posted: Condvar::new(),
            })
        };
        let (shared, lane) = (new(), new());
        (0..n)
            .map(|rank| Virtual {
                rank,
                shared: shared.clone(),
                staging: Vec::new(),
                lane: Lane { shared: lane.clone(), worker: None, pending: 0 },
            })
            .collect()
    }

    fn exchange(&mut self, data: &[f32], group: &[usize], combine: impl FnOnce(&[&[f32]])) {
        exchange(&self.shared, self.rank, data, group, combine);
    }

    /// Hands `op` over `input` to the second lane, whose result goes to `output` at the wait.
    fn start<B: Backend>(&mut self, be: &mut B, op: Op, input: View, output: View, group: &[usize]) {
        let mut data = vec![0f32; input.len];
        be.download_message(input, &mut data);
        let (rank, lane) = (self.rank, &mut self.lane);
        let (jobs, _) = lane.worker.get_or_insert_with(|| {
            let (jobs, inbox) = channel::<Started>();
            let (outbox, results) = channel();
            let shared = lane.shared.clone();
            std::thread::spawn(move || {
                for (op, view, data, group) in inbox {
                    let mut out = Vec::new();
                    exchange(&shared, rank, &data, &group, |parts| {
                        out = match op {
                            Op::Sum => sum_of(parts, data.len()),
                            Op::Gather => parts.concat(),
                        }
                    });
                    if outbox.send((view, out)).is_err() {
                        break;
                    }
                }
            });
            (jobs, results)
        });
        jobs.send((op, output, data, group.to_vec())).expect("the collectives worker is running");
        lane.pending += 1;
    }
}

/// Publishes `data` in `rank`'s slot, waits for the group, runs `combine` over every member's
/// data in group order, and waits again so nobody overwrites a slot still being read.
fn exchange(shared: &Shared, rank: usize, data: &[f32], group: &[usize], combine: impl FnOnce(&[&[f32]])) {
    assert!(group.contains(&rank), "rank {rank} is not in group {group:?}");
    let barrier = {
        let mut map = shared.barriers.lock().expect("barrier map");
        map.entry(group.to_vec()).or_insert_with(|| Arc::new(Barrier::new(group.len()))).clone()
    };
    {
        let mut slot = shared.slots[rank].lock().expect("slot");
        slot.clear();
        slot.extend_from_slice(data);
    }
    barrier.wait();
    {
        let guards: Vec<_> = group.iter().map(|&r| shared.slots[r].lock().expect("slot")).collect();
        let views: Vec<&[f32]> = guards.iter().map(|g| g.as_slice()).collect();
        combine(&views);
    }
    barrier.wait();
}

/// `max parts`, element by element.
pub(crate) fn max_of(parts: &[&[f32]], len: usize) -> Vec<f32> {
    let mut max = vec![f32::NEG_INFINITY; len];
    for part in parts {
        max.iter_mut().zip(*part).for_each(|(m, &x)| *m = m.max(x));
    }
    max
}

/// `Σ parts`, element by element, in part order.
fn sum_of(parts: &[&[f32]], len: usize) -> Vec<f32> {
    let mut sum = vec![0f32; len];
    for part in parts {
        sum.iter_mut().zip(*part).for_each(|(s, x)| *s += x);
    }
    sum
}

impl<B: Backend> Collectives<B> for Virtual {
    fn rank(&self) -> usize {
        self.rank
    }

    fn all_reduce_sum(&mut self, be: &mut B, buf: View, group: &[usize]) {
        let mut data = std::mem::take(&mut self.staging);
        data.resize(buf.len, 0.0);
        be.download(buf, &mut data);
        let mut sum = Vec::new();
        self.exchange(&data, group, |parts| sum = sum_of(parts, buf.len));
        be.upload(buf, &sum);
        self.staging = data;
    }

    fn all_reduce_max(&mut self, be: &mut B, buf: View, group: &[usize]) {
        let mut data = std::mem::take(&mut self.staging);
        data.resize(buf.len, 0.0);
        be.download(buf, &mut data);
        let mut max = Vec::new();
        self.exchange(&data, group, |parts| max = max_of(parts, buf.len));
        be.upload(buf, &max);
        self.staging = data;
    }

    fn all_reduce_sum_start(&mut self, be: &mut B, buf: View, group: &[usize]) {
        self.start(be, Op::Sum, buf, buf, group);
    }

    fn all_gather_start(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        assert_eq!(output.len, input.len * group.len(), "all-gather sizes");
        self.start(be, Op::Gather, input, output, group);
    }

    fn wait(&mut self, be: &mut B) {
        let Some((_, results)) = &self.lane.worker else { return };
        for _ in 0..std::mem::take(&mut self.lane.pending) {
            let (view, sum) = results.recv().expect("the collectives worker is running");
            be.upload_message(view, &sum);
        }
    }

    fn send_recv(&mut self, be: &mut B, sends: &[(View, usize)], recvs: &[(View, usize)]) {
        // Sends are posted at once (a mailbox holds them), so only a receive waits.
        for &(buf, to) in sends {
            let mut data = vec![0f32; buf.len];
            be.download(buf, &mut data);
            let mut mail = self.shared.mail.lock().expect("mailboxes");
            mail.entry((self.rank, to)).or_default().push_back(data);
            self.shared.posted.notify_all();
        }
        for &(buf, from) in recvs {
            let mut mail = self.shared.mail.lock().expect("mailboxes");
            let data = loop {
                if let Some(data) = mail.get_mut(&(from, self.rank)).and_then(VecDeque::pop_front) {
                    break data;
                }
                mail = self.shared.posted.wait(mail).expect("mailboxes");
            };
            drop(mail);
            assert_eq!(
                data.len(),
                buf.len,
                "rank {from} sent {} elements, rank {} expects {}",
                data.len(),
                self.rank,
                buf.len
            );
            be.upload(buf, &data);
        }
    }

    fn all_to_all(&mut self, be: &mut B, input: View, send: &[usize], output: View, group: &[usize]) -> Vec<usize> {
        check_all_to_all(input, send, group);
        let (n, me) = (group.len(), group.iter().position(|&r| r == self.rank).expect("member"));
        // One slot holds the counts, then the parts: the counts come first, as on the wire.
        let total: usize = send.iter().sum();
        let mut data = std::mem::take(&mut self.staging);
        data.clear();
        data.extend(send.iter().map(|&c| count_to_f32(c)));
        data.resize(n + total, 0.0);
        be.download(input.at(0, total), &mut data[n..]);
        let (mut recv, mut all) = (Vec::with_capacity(n), Vec::new());
        self.exchange(&data, group, |parts| {
            for part in parts {
                let counts: Vec<usize> = part[..n].iter().map(|&x| f32_to_count(x)).collect();
                let at = n + starts(&counts)[me];
                all.extend_from_slice(&part[at..at + counts[me]]);
                recv.push(counts[me]);
            }
        });
        check_received(&recv, output, self.rank);
        if !all.is_empty() {
            be.upload(output.at(0, all.len()), &all);
        }
        self.staging = data;
        recv
    }

    fn reduce_scatter_sum(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        assert_eq!(input.len, output.len * group.len(), "reduce-scatter sizes");
        let me = group.iter().position(|&r| r == self.rank).expect("member");
        let mut data = std::mem::take(&mut self.staging);
        data.resize(input.len, 0.0);
        be.download(input, &mut data);
        let mut mine = vec![0f32; output.len];
        self.exchange(&data, group, |parts| {
            for part in parts {
                mine.iter_mut().zip(&part[me * output.len..(me + 1) * output.len]).for_each(|(s, x)| *s += x);
            }
        });
        be.upload(output, &mine);
        self.staging = data;
    }

    fn all_gather(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        assert_eq!(output.len, input.len * group.len(), "all-gather sizes");
        let mut data = std::mem::take(&mut self.staging);
        data.resize(input.len, 0.0);
        be.download_message(input, &mut data);
        let mut all = Vec::with_capacity(output.len);
        self.exchange(&data, group, |parts| parts.iter().for_each(|p| all.extend_from_slice(p)));
        be.upload_message(output, &all);
        self.staging = data;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::backend::{BufKind, cpu::Cpu};

    /// Runs `f(rank, comm, backend)` on `n` virtual devices, each on its own thread.
    pub(crate) fn on_devices<T: Send + 'static>(
        n: usize,
        f: impl Fn(usize, &mut Virtual, &mut Cpu) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = Arc::new(f);
        let handles: Vec<_> = Virtual::devices(n)
            .into_iter()
            .enumerate()
            .map(|(rank, mut comm)| {
                let f = f.clone();
                std::thread::spawn(move || f(rank, &mut comm, &mut Cpu::new()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("device thread")).collect()
    }

    /// Member `from` sends member `to` `(from + 2·to) % 3` elements (some parts empty, its own
    /// included), each naming sender, receiver and position.
    fn part(from: usize, to: usize) -> Vec<f32> {
        (0..(from + 2 * to) % 3).map(|i| (100 * from + 10 * to + i) as f32).collect()
    }

    #[test]
    fn all_to_all_moves_parts_of_any_size_in_group_order() {
        let results = on_devices(4, |rank, comm, cpu| {
            // Groups {0, 2} and {1, 3}, then the world, twice each: counts never mix.
            let pairs = if rank % 2 == 0 { vec![0, 2] } else { vec![1, 3] };
            let mut got = Vec::new();
            for group in [pairs.clone(), vec![0, 1, 2, 3], pairs, vec![0, 1, 2, 3]] {
                let send: Vec<usize> = group.iter().map(|&to| part(rank, to).len()).collect();
                let data: Vec<f32> = group.iter().flat_map(|&to| part(rank, to)).collect();
                // Buffers larger than the parts: the rest of the output keeps its values.
                let (input, output) =
                    (cpu.alloc(BufKind::Activations, data.len() + 3), cpu.alloc(BufKind::Activations, 12));
                cpu.upload(input.at(0, data.len()), &data);
                cpu.fill(output, -1.0);
                let recv = Collectives::<Cpu>::all_to_all(comm, cpu, input, &send, output, &group);
                let mut out = vec![0f32; 12];
                cpu.download(output, &mut out);
                got.push((group, recv, out));
            }
            got
        });
        for (rank, got) in results.into_iter().enumerate() {
            for (group, recv, out) in got {
                let want: Vec<f32> = group.iter().flat_map(|&from| part(from, rank)).collect();
                let counts: Vec<usize> = group.iter().map(|&from| part(from, rank).len()).collect();
                assert_eq!(recv, counts, "rank {rank}, group {group:?}: counts");
                assert_eq!(out[..want.len()], want[..], "rank {rank}, group {group:?}: parts");
                assert!(out[want.len()..].iter().all(|&x| x == -1.0), "rank {rank}: past the parts");
            }
        }
        // A device alone keeps its own part.
        let mut cpu = Cpu::new();
        let (input, output) = (cpu.alloc(BufKind::Activations, 3), cpu.alloc(BufKind::Activations, 3));
        cpu.upload(input, &[1.0, 2.0, 3.0]);
        assert_eq!(Collectives::<Cpu>::all_to_all(&mut Solo, &mut cpu, input, &[2], output, &[0]), [2]);
        let mut out = vec![0f32; 3];
        cpu.download(output, &mut out);
        assert_eq!(out[..2], [1.0, 2.0]);
        assert_eq!((count_to_f32(0), f32_to_count(count_to_f32(u32::MAX as usize))), (0.0, u32::MAX as usize));
    }

    #[test]
    fn all_reduce_reduce_scatter_and_all_gather_in_groups() {
        let results = on_devices(4, |rank, comm, cpu| {
            let buf = cpu.alloc(BufKind::Grads, 4);
            cpu.upload(buf, &[rank as f32, 1.0, 2.0 * rank as f32, 0.5]);
            // Two groups of two: {0, 2} and {1, 3}.
            let group = if rank % 2 == 0 { vec![0, 2] } else { vec![1, 3] };
            Collectives::<Cpu>::all_reduce_sum(comm, cpu, buf, &group);
            let mut reduced = vec![0f32; 4];
            cpu.download(buf, &mut reduced);
            let top = cpu.alloc(BufKind::Scalars, 2);
            cpu.upload(top, &[rank as f32, -(rank as f32)]);
            Collectives::<Cpu>::all_reduce_max(comm, cpu, top, &group);
            let mut maxima = vec![0f32; 2];
            cpu.download(top, &mut maxima);
            assert_eq!(
                maxima,
                [(rank % 2 + 2) as f32, -((rank % 2) as f32)],
                "rank {rank}: the maximum over {group:?}"
            );

            let (input, shard) = (cpu.alloc(BufKind::Grads, 4), cpu.alloc(BufKind::Grads, 1));
            cpu.upload(input, &[1.0, 2.0, 3.0, 4.0].map(|x| x * (rank + 1) as f32));
            Collectives::<Cpu>::reduce_scatter_sum(comm, cpu, input, shard, &[0, 1, 2, 3]);
            let mut scattered = [0f32];
            cpu.download(shard, &mut scattered);

            let gathered = cpu.alloc(BufKind::Params, 4);
            Collectives::<Cpu>::all_gather(comm, cpu, shard, gathered, &[0, 1, 2, 3]);
            let mut all = vec![0f32; 4];
            cpu.download(gathered, &mut all);
            // Two sums started, a synchronous one in between, then the wait.
            let (x, y) = (cpu.alloc(BufKind::Grads, 3), cpu.alloc(BufKind::Grads, 2));
            cpu.upload(x, &[rank as f32; 3]);
            cpu.upload(y, &[1.0, rank as f32]);
            Collectives::<Cpu>::all_reduce_sum_start(comm, cpu, x, &[0, 1, 2, 3]);
            Collectives::<Cpu>::all_reduce_sum_start(comm, cpu, y, &group);
            Collectives::<Cpu>::all_reduce_sum(comm, cpu, gathered, &[0, 1, 2, 3]);
            Collectives::<Cpu>::wait(comm, cpu);
            let (mut xs, mut ys) = (vec![0f32; 3], vec![0f32; 2]);
            cpu.download(x, &mut xs);
            cpu.download(y, &mut ys);
            // A ring of sends and receives, twice, without deadlock.
            let (out, inbox) = (cpu.alloc(BufKind::Activations, 2), cpu.alloc(BufKind::Activations, 2));
            let (next, prev) = ((rank + 1) % 4, (rank + 3) % 4);
            let mut got = Vec::new();
            for round in 0..2 {
                cpu.upload(out, &[rank as f32, round as f32]);
                Collectives::<Cpu>::send_recv(comm, cpu, &[(out, next)], &[(inbox, prev)]);
                let mut v = vec![0f32; 2];
                cpu.download(inbox, &mut v);
                got.push(v);
            }
            let want = vec![vec![prev as f32, 0.0], vec![prev as f32, 1.0]];
            (reduced, scattered[0], all, xs, ys, got, want)
        });
        assert!(results.iter().all(|r| r.3 == vec![6.0; 3]));
        assert_eq!((results[0].4.clone(), results[1].4.clone()), (vec![2.0, 2.0], vec![2.0, 4.0]));
        assert_eq!(results[0].0, vec![2.0, 2.0, 4.0, 1.0]);
        assert!(results.iter().all(|r| r.5 == r.6), "point-to-point messages arrive in order");
        assert_eq!(results[3].0, vec![4.0, 2.0, 8.0, 1.0]);
        // Σ (rank + 1) = 10: member i gets 10 · (i + 1).
        assert_eq!(results.iter().map(|r| r.1).collect::<Vec<_>>(), vec![10.0, 20.0, 30.0, 40.0]);
        assert!(results.iter().all(|r| r.2 == vec![10.0, 20.0, 30.0, 40.0]));
    }
}
