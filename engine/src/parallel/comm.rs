//! Collectives: the operations devices use to combine their work.
//!
//! One interface, [`Collectives`], over backend buffers. Groups are the ranks of one mesh axis
//! ([`crate::parallel::mesh::Mesh::group`]), listed in axis order; every member calls the same
//! operation with buffers of the same size. Three implementations: NCCL for GPUs (one process per
//! GPU), [`Virtual`] for CPU devices running as threads of one process, so that every
//! sharding path runs without GPUs, and [`Solo`] for a device alone. Sums are added in group order, so results are deterministic.

use std::collections::{HashMap, VecDeque};
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
    /// All-to-all in equal parts (the expert axis's token exchange, in fixed-size parts as
    /// Megatron-Core's drop-and-pad dispatcher moves them): `input` holds, one after the other
    /// in group order, the part this member sends each member (its own included), `input.len /
    /// n` elements each; `output` (as long) receives, in group order, the part each member
    /// sent this one. No count travels and nothing is read back to the host: the shapes are
    /// the caller's. Parts are copied, never added, so every implementation gives the same bits.
    fn all_to_all(&mut self, be: &mut B, input: View, output: View, group: &[usize]);
    /// Whether every collective may be issued inside a recorded section
    /// ([`Backend::begin_section`]), the virtual devices' as host calls in the stream of work
    /// ([`Backend::host_call`]): several devices may then record their micro-batches as graphs.
    fn captures_sections(&self) -> bool {
        false
    }
}

/// Checks an all-to-all's buffers before anything travels and returns the part's length
/// (internal errors: the callers size the buffers).
pub(crate) fn all_to_all_part(input: View, output: View, group: &[usize]) -> usize {
    let n = group.len();
    assert!(
        input.len == output.len && input.len.is_multiple_of(n),
        "internal error: an all-to-all from {} to {} elements over a group of {n}",
        input.len,
        output.len
    );
    input.len / n
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

    fn all_to_all(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        debug_assert_eq!(group, [0], "a device alone has no peers");
        all_to_all_part(input, output, group);
        be.copy(output, input);
    }

    fn captures_sections(&self) -> bool {
        true
    }
}

/// Devices of one process meeting in shared memory: create one [`Virtual`] per device with
/// [`Virtual::devices`] and move each to its own thread.
///
/// Every operation moves its data as a host call in the device's stream of work
/// ([`Backend::host_call`]): where the backend records work (the CUDA emulator's graphs), the
/// exchange is recorded with it and made again at each replay, so that a section holding
/// collectives is recorded once and replayed, as NCCL's kernels are captured on a GPU. Started
/// operations complete at once (the trait's default): a second lane of host-side bookkeeping
/// would not follow a replayed section, whose host code does not run again.
pub struct Virtual {
    rank: usize,
    shared: Arc<Shared>,
}

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
        let shared = Arc::new(Shared {
            slots: (0..n).map(|_| Mutex::new(Vec::new())).collect(),
            barriers: Mutex::new(HashMap::new()),
            mail: Mutex::new(HashMap::new()),
            posted: Condvar::new(),
        });
        (0..n).map(|rank| Virtual { rank, shared: shared.clone() }).collect()
    }

    /// Meets the group as a host call reading `reads` and writing `writes`: `combine` gets
    /// every member's data in group order and fills this member's result.
    fn meet<B: Backend>(
        &mut self,
        be: &mut B,
        (reads, writes): (View, View),
        group: &[usize],
        combine: impl Fn(&[&[f32]], &mut [f32]) + Send + Sync + 'static,
    ) {
        let (shared, rank, group) = (self.shared.clone(), self.rank, group.to_vec());
        be.host_call(
            reads,
            writes,
            Arc::new(move |data, out| exchange(&shared, rank, data, &group, |parts| combine(parts, out))),
        );
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
        self.meet(be, (buf, buf), group, |parts, out| out.copy_from_slice(&sum_of(parts, out.len())));
    }

    fn all_reduce_max(&mut self, be: &mut B, buf: View, group: &[usize]) {
        self.meet(be, (buf, buf), group, |parts, out| out.copy_from_slice(&max_of(parts, out.len())));
    }

    fn send_recv(&mut self, be: &mut B, sends: &[(View, usize)], recvs: &[(View, usize)]) {
        // Sends are posted at once (a mailbox holds them), so only a receive waits. (Pipeline
        // handoffs lie between sections, so these move data directly.)
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

    fn all_to_all(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        let part = all_to_all_part(input, output, group);
        let me = group.iter().position(|&r| r == self.rank).expect("member");
        self.meet(be, (input, output), group, move |parts, out| {
            for (j, from) in parts.iter().enumerate() {
                out[j * part..(j + 1) * part].copy_from_slice(&from[me * part..(me + 1) * part]);
            }
        });
    }

    fn reduce_scatter_sum(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        assert_eq!(input.len, output.len * group.len(), "reduce-scatter sizes");
        let (me, len) = (group.iter().position(|&r| r == self.rank).expect("member"), output.len);
        self.meet(be, (input, output), group, move |parts, out| {
            out.fill(0.0);
            for part in parts {
                out.iter_mut().zip(&part[me * len..(me + 1) * len]).for_each(|(s, x)| *s += x);
            }
        });
    }

    fn all_gather(&mut self, be: &mut B, input: View, output: View, group: &[usize]) {
        assert_eq!(output.len, input.len * group.len(), "all-gather sizes");
        self.meet(be, (input, output), group, |parts, out| {
            let mut at = 0;
            for p in parts {
                out[at..at + p.len()].copy_from_slice(p);
                at += p.len();
            }
        });
    }

    fn captures_sections(&self) -> bool {
        true
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

    /// The part member `from` sends member `to`: three elements naming sender, receiver and
    /// position.
    fn part(from: usize, to: usize) -> Vec<f32> {
        (0..3).map(|i| (100 * from + 10 * to + i) as f32).collect()
    }

    #[test]
    fn all_to_all_moves_parts_in_group_order() {
        let results = on_devices(4, |rank, comm, cpu| {
            // Groups {0, 2} and {1, 3}, then the world, twice each: parts never mix.
            let pairs = if rank % 2 == 0 { vec![0, 2] } else { vec![1, 3] };
            let mut got = Vec::new();
            for group in [pairs.clone(), vec![0, 1, 2, 3], pairs, vec![0, 1, 2, 3]] {
                let data: Vec<f32> = group.iter().flat_map(|&to| part(rank, to)).collect();
                let (input, output) =
                    (cpu.alloc(BufKind::Activations, data.len()), cpu.alloc(BufKind::Activations, data.len()));
                cpu.upload(input, &data);
                Collectives::<Cpu>::all_to_all(comm, cpu, input, output, &group);
                let mut out = vec![0f32; data.len()];
                cpu.download(output, &mut out);
                got.push((group, out));
            }
            got
        });
        for (rank, got) in results.into_iter().enumerate() {
            for (group, out) in got {
                let want: Vec<f32> = group.iter().flat_map(|&from| part(from, rank)).collect();
                assert_eq!(out, want, "rank {rank}, group {group:?}");
            }
        }
        // A device alone keeps its own part.
        let mut cpu = Cpu::new();
        let (input, output) = (cpu.alloc(BufKind::Activations, 3), cpu.alloc(BufKind::Activations, 3));
        cpu.upload(input, &[1.0, 2.0, 3.0]);
        Collectives::<Cpu>::all_to_all(&mut Solo, &mut cpu, input, output, &[0]);
        let mut out = vec![0f32; 3];
        cpu.download(output, &mut out);
        assert_eq!(out, [1.0, 2.0, 3.0]);
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
