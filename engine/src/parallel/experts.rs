//! The expert axis's token exchange: experts distributed whole over an expert group
//! ([`Mesh::expert_group`]), each token's rows sent to its experts' devices by an all-to-all
//! ([`Collectives::all_to_all`]) and brought back by the reverse one, as Megatron-Core's
//! all-to-all token dispatcher and MaxText's expert axis do.
//!
//! **Placement.** Of `E` experts over a group of `n` members, member `j` holds the `L = E / n`
//! experts `[j·L, (j+1)·L)`, whole.
//!
//! **Dispatch.** Rows leave a device grouped by expert, as the routing's gather lays them out
//! (expert 0's rows, then expert 1's, …), so the rows bound for member `j` are one contiguous
//! part and one all-to-all moves them all. The rows per expert travel first (a small all-to-all
//! of `L` counts to each member), so that each member knows where each of its experts' rows lie
//! in what arrives ([`Received`]):
//!
//! ```text
//! sent by member s:   [ to 0: experts 0..L | to 1: experts L..2L | … ]
//! received by j:      [ from 0: j·L, j·L+1, … | from 1: j·L, j·L+1, … | … ]
//! ```
//!
//! **Return.** [`ExpertExchange::give_back`] is the same exchange backwards: each member sends
//! back, in the order it received them, the rows it computed, and each sender finds its rows
//! where they were. Moving rows is a permutation, whose adjoint is its inverse, so the backward
//! pass takes the reverse path: the gradients of the returned rows go out by
//! [`ExpertExchange::dispatch_again`], and those of the dispatched rows come back by
//! [`ExpertExchange::give_back`]. Rows are copied, never added: the exchange itself changes no
//! bits.
//!
//! **The rest of the axis.** The expert axis is carved out of the data axis: the other
//! parameters are replicated (or FSDP-sharded) over the data ranks as without it, and an
//! expert's gradients are summed over [`Mesh::expert_replicas`], the data ranks that hold the
//! same experts.
//!
//! [`Mesh::expert_group`]: super::mesh::Mesh::expert_group
//! [`Mesh::expert_replicas`]: super::mesh::Mesh::expert_replicas

use std::ops::Range;

use super::comm::{Collectives, count_to_f32, f32_to_count};
use crate::backend::{Backend, BufKind, View};
use crate::config::Remat;

/// The all-to-alls of `[tokens · k, d_model]` rows a mixture-of-experts layer makes a
/// micro-batch on an expert axis: dispatch and return, forward and backward, and the forward's
/// two again where full recomputation runs the layer again.
pub fn all_to_alls_per_layer(remat: Remat) -> usize {
    if remat == Remat::Full { 6 } else { 4 }
}

/// One device's part in an expert group.
pub struct ExpertExchange {
    group: Vec<usize>,
    /// This device's position in the group.
    me: usize,
    /// Experts per member.
    local: usize,
    /// The counts' exchange: what this member sends each member (`L` counts each), then what
    /// each sends it.
    counts: View,
}

/// What one dispatch brought to a member: the rows of each of its experts from each member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// `from[s][l]`: rows that member `s` sent for this member's `l`-th expert.
    pub from: Vec<Vec<usize>>,
    /// Rows this member sent to each member (what comes back to it).
    pub sent: Vec<usize>,
}

impl Received {
    /// Rows received, in all.
    pub fn rows(&self) -> usize {
        self.from.iter().flatten().sum()
    }

    /// Rows received for each local expert, in all.
    pub fn per_expert(&self) -> Vec<usize> {
        let experts = self.from.first().map_or(0, Vec::len);
        (0..experts).map(|l| self.from.iter().map(|f| f[l]).sum()).collect()
    }

    /// The received rows as `(local expert, rows)` runs, in the order they lie: by sender, then
    /// by expert (empty runs left out).
    pub fn runs(&self) -> Vec<(usize, Range<usize>)> {
        let mut at = 0;
        let mut runs = Vec::new();
        for from in &self.from {
            for (l, &rows) in from.iter().enumerate() {
                if rows > 0 {
                    runs.push((l, at..at + rows));
                }
                at += rows;
            }
        }
        runs
    }
}

impl ExpertExchange {
    /// This device's part in `group` (its expert group, in expert-axis order) for `experts`
    /// experts, which the group's size divides (checked with the mesh:
    /// [`super::mesh::Mesh::check_model`]).
    pub fn new<B: Backend>(be: &mut B, group: Vec<usize>, rank: usize, experts: usize) -> ExpertExchange {
        let n = group.len();
        assert!(experts.is_multiple_of(n), "internal error: {experts} experts over an expert group of {n}");
        let me = group.iter().position(|&r| r == rank).expect("internal error: a rank outside its expert group");
        let local = experts / n;
        let counts = be.alloc(BufKind::Scalars, 2 * n * local);
        ExpertExchange { group, me, local, counts }
    }

    /// The experts this device holds.
    pub fn local_experts(&self) -> Range<usize> {
        self.me * self.local..(self.me + 1) * self.local
    }

    /// Sends `rows` (rows of `width` elements grouped by expert: `counts[e]` rows for expert
    /// `e`, every expert of the model in order) to the members holding their experts, and
    /// receives into `out` the rows every member sends this one's experts, as the module
    /// documentation lays them out. `out` holds at least the rows received (dropless: at
    /// worst, every member's rows).
    pub fn dispatch<B: Backend>(
        &mut self,
        comm: &mut (impl Collectives<B> + ?Sized),
        be: &mut B,
        rows: View,
        counts: &[usize],
        width: usize,
        out: View,
    ) -> Received {
        let (n, l) = (self.group.len(), self.local);
        assert_eq!(counts.len(), n * l, "internal error: rows for {} experts, {} expected", counts.len(), n * l);
        let host: Vec<f32> = counts.iter().map(|&c| count_to_f32(c)).collect();
        be.upload(self.counts.at(0, n * l), &host);
        let (mine, theirs) = (self.counts.at(0, n * l), self.counts.at(n * l, n * l));
        let got = comm.all_to_all(be, mine, &vec![l; n], theirs, &self.group);
        assert!(got.iter().all(|&c| c == l), "internal error: expert counts {got:?}, {l} from each expected");
        let mut host = vec![0f32; n * l];
        be.download(theirs, &mut host);
        let from: Vec<Vec<usize>> = host.chunks(l).map(|c| c.iter().map(|&x| f32_to_count(x)).collect()).collect();
        let sent: Vec<usize> = counts.chunks(l).map(|c| c.iter().sum()).collect();
        let elements: Vec<usize> = sent.iter().map(|r| r * width).collect();
        let recv = comm.all_to_all(be, rows, &elements, out, &self.group);
        let received = Received { from, sent };
        let expected: Vec<usize> = received.from.iter().map(|f| f.iter().sum::<usize>() * width).collect();
        assert_eq!(recv, expected, "internal error: the rows received disagree with the experts' counts");
        received
    }

    /// The dispatch's exchange again, with the counts of an earlier one (the backward pass:
    /// the gradients of the rows [`ExpertExchange::give_back`] returned go out as those rows
    /// went out).
    pub fn dispatch_again<B: Backend>(
        &mut self,
        comm: &mut (impl Collectives<B> + ?Sized),
        be: &mut B,
        rows: View,
        received: &Received,
        width: usize,
        out: View,
    ) {
        let elements: Vec<usize> = received.sent.iter().map(|r| r * width).collect();
        let recv = comm.all_to_all(be, rows, &elements, out, &self.group);
        let expected: Vec<usize> = received.from.iter().map(|f| f.iter().sum::<usize>() * width).collect();
        assert_eq!(recv, expected, "internal error: the rows received disagree with the dispatch's");
    }

    /// Sends back rows laid out as `received` arrived (the experts' outputs, or the gradients
    /// of the dispatched rows) to the members they came from; `out` receives this member's
    /// rows where they were when dispatched (grouped by expert, every expert in order).
    pub fn give_back<B: Backend>(
        &mut self,
        comm: &mut (impl Collectives<B> + ?Sized),
        be: &mut B,
        rows: View,
        received: &Received,
        width: usize,
        out: View,
    ) {
        let elements: Vec<usize> = received.from.iter().map(|f| f.iter().sum::<usize>() * width).collect();
        let back = comm.all_to_all(be, rows, &elements, out, &self.group);
        let expected: Vec<usize> = received.sent.iter().map(|r| r * width).collect();
        assert_eq!(back, expected, "internal error: the rows returned disagree with the rows sent");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::parallel::comm::Virtual;
    use crate::parallel::mesh::Mesh;

    const EXPERTS: usize = 8;
    const WIDTH: usize = 3;

    /// Rows device `rank` routes to `expert`: some none, some several.
    fn routed(rank: usize, expert: usize) -> usize {
        (rank * 5 + expert * 3) % 4
    }

    /// The row values: sender, expert, row and column can all be read back from them.
    fn row(rank: usize, expert: usize, i: usize) -> Vec<f32> {
        (0..WIDTH).map(|c| (1000 * rank + 100 * expert + 10 * i + c) as f32).collect()
    }

    /// An "expert" that the test can compute anywhere: row × (expert + 1) + column.
    fn apply(expert: usize, x: &[f32]) -> Vec<f32> {
        x.iter().enumerate().map(|(c, v)| v * (expert + 1) as f32 + c as f32).collect()
    }

    /// Every device of 4 dispatches its rows over its expert group (`groups` of 2 or 4),
    /// applies its experts to what it received, and gives the results back; each finds its own
    /// rows' results where its rows were, and what it received is what its experts were sent.
    fn exchange_over(groups: fn(usize) -> Vec<usize>) {
        crate::parallel::comm::tests::on_devices(4, move |rank: usize, comm: &mut Virtual, be: &mut Cpu| {
            let group = groups(rank);
            let mut ex = ExpertExchange::new(be, group.clone(), rank, EXPERTS);
            let counts: Vec<usize> = (0..EXPERTS).map(|e| routed(rank, e)).collect();
            let rows: Vec<f32> = (0..EXPERTS).flat_map(|e| (0..counts[e]).flat_map(move |i| row(rank, e, i))).collect();
            let worst = group.len() * 3 * EXPERTS * WIDTH;
            let (input, received_rows) = (be.alloc(BufKind::Activations, worst), be.alloc(BufKind::Activations, worst));
            be.upload(input.at(0, rows.len()), &rows);
            let received = ex.dispatch(comm, be, input, &counts, WIDTH, received_rows);
            let mut got = vec![0f32; received.rows() * WIDTH];
            be.download(received_rows.at(0, got.len()), &mut got);
            // What arrived: each sender's rows for each of this device's experts, in order.
            let local = ex.local_experts();
            let mut want = Vec::new();
            for &s in &group {
                for e in local.clone() {
                    want.extend((0..routed(s, e)).flat_map(|i| row(s, e, i)));
                }
            }
            assert_eq!(got, want, "rank {rank}: the rows dispatched to it");
            assert_eq!(
                received.per_expert(),
                local.clone().map(|e| group.iter().map(|&s| routed(s, e)).sum()).collect::<Vec<usize>>()
            );
            // The experts applied, run by run, and the results given back.
            let mut out = Vec::new();
            for (l, run) in received.runs() {
                for r in run {
                    out.extend(apply(local.start + l, &got[r * WIDTH..(r + 1) * WIDTH]));
                }
            }
            be.upload(received_rows.at(0, out.len()), &out);
            let back = be.alloc(BufKind::Activations, worst);
            ex.give_back(comm, be, received_rows, &received, WIDTH, back);
            let mut results = vec![0f32; rows.len()];
            be.download(back.at(0, rows.len()), &mut results);
            let want: Vec<f32> =
                (0..EXPERTS).flat_map(|e| (0..counts[e]).flat_map(move |i| apply(e, &row(rank, e, i)))).collect();
            assert_eq!(results, want, "rank {rank}: its rows' results, back where its rows were");
            // The backward pass's way out: the returned rows' gradients travel as the rows did.
            be.upload(input.at(0, rows.len()), &rows);
            ex.dispatch_again(comm, be, input, &received, WIDTH, received_rows);
            let mut again = vec![0f32; received.rows() * WIDTH];
            be.download(received_rows.at(0, again.len()), &mut again);
            assert_eq!(again, got, "rank {rank}: the second dispatch");
        });
    }

    #[test]
    fn rows_reach_their_experts_and_come_back_in_place() {
        exchange_over(|_| vec![0, 1, 2, 3]);
        exchange_over(|rank| if rank < 2 { vec![0, 1] } else { vec![2, 3] });
    }

    #[test]
    fn a_group_of_one_keeps_its_rows() {
        let mut be = Cpu::new();
        let mut ex = ExpertExchange::new(&mut be, vec![0], 0, 2);
        let (input, out) = (be.alloc(BufKind::Activations, 6), be.alloc(BufKind::Activations, 6));
        be.upload(input, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let received = ex.dispatch(&mut crate::parallel::comm::Solo, &mut be, input, &[1, 2], 2, out);
        assert_eq!(received, Received { from: vec![vec![1, 2]], sent: vec![3] });
        assert_eq!(received.runs(), vec![(0, 0..1), (1, 1..3)]);
        assert_eq!(ex.local_experts(), 0..2);
    }

    /// The expert groups that the mesh places: consecutive data ranks within a node, and the
    /// replicas that sum an expert's gradients.
    #[test]
    fn the_mesh_places_expert_groups_within_the_data_axis() {
        let cfg = crate::config::MeshConfig { ici_data: 4, ici_expert: 2, dcn_data: 2, ..Default::default() };
        let m = Mesh::resolve(&cfg, 4, 2).unwrap();
        assert_eq!((m.expert_size(), m.group(0, crate::parallel::mesh::Axis::Data)), (2, vec![0, 1, 2, 3, 4, 5, 6, 7]));
        assert_eq!(m.expert_group(0), vec![0, 1]);
        assert_eq!(m.expert_group(3), vec![2, 3]);
        assert_eq!(m.expert_group(6), vec![6, 7]);
        assert_eq!(m.expert_replicas(1), vec![1, 3, 5, 7]);
        // Across nodes: the expert group spans the two nodes, each node a replica within.
        let cfg = crate::config::MeshConfig { ici_data: 2, dcn_data: 2, dcn_expert: 2, ..Default::default() };
        let m = Mesh::resolve(&cfg, 2, 2).unwrap();
        assert_eq!((m.expert_group(1), m.expert_replicas(1)), (vec![1, 3], vec![0, 1]));
        // With FSDP and tensor: expert groups lie within one data group.
        let cfg =
            crate::config::MeshConfig { ici_data: 2, ici_fsdp: 2, ici_tensor: 2, ici_expert: 2, ..Default::default() };
        let m = Mesh::resolve(&cfg, 8, 1).unwrap();
        for r in 0..8 {
            let g = m.expert_group(r);
            assert_eq!(g, m.group(r, crate::parallel::mesh::Axis::Data), "rank {r}");
            assert_eq!(m.expert_replicas(r), vec![r]);
        }
    }
}
