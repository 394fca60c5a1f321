//! The expert axis's token exchange: experts distributed whole over an expert group
//! ([`Mesh::expert_group`]), each token's rows sent to its experts' devices by an all-to-all
//! ([`Collectives::all_to_all`]) and brought back by the reverse one, as Megatron-Core's
//! all-to-all token dispatcher and MaxText's expert axis do.
//!
//! **Placement.** Of `E` experts over a group of `n` members, member `j` holds the `L = E / n`
//! experts `[j·L, (j+1)·L)`, whole.
//!
//! **Dispatch, in parts of fixed size.** Rows leave a device grouped by expert, as the
//! routing's gather lays them out (expert 0's rows, then expert 1's, …), so the rows bound for
//! member `j` are one contiguous run. Each run is packed into a part of `P` rows, zeros after it
//! ([`Backend::moe_pack`]), `P` being the most one member can route to another's experts: `N·k`
//! dropless, `L·C` under a capacity factor, whichever is less. One all-to-all moves the parts
//! ([`Collectives::all_to_all`]); a second, of `L` counts to each member, tells each member
//! how many rows of each part are its experts' ([`Backend::moe_counts`]), from which the device
//! writes the runs the grouped products read ([`Backend::moe_runs`]):
//!
//! ```text
//! sent by member s:   [ to 0: experts 0..L, zeros | to 1: experts L..2L, zeros | … ]   n parts of P rows
//! received by j:      [ from 0: j·L, j·L+1, …, zeros | from 1: j·L, j·L+1, …, zeros | … ]
//! ```
//!
//! Nothing travels through the host: the shapes are the plan's, whatever the routing, so a
//! step with an expert axis can be recorded as a CUDA graph (where the communicator allows
//! it), and no count is read back mid-step, dropless or not. The price is the padding: parts
//! of `P` rows move whether full or not (`n·P` rows a member where the routing fills `N·k`
//! in all; a capacity factor bounds `P`).
//!
//! **Return.** The same exchange backwards: each member sends back, part by part, the rows it
//! computed where they arrived, and each sender unpacks its rows where they were
//! ([`Backend::moe_unpack`]). Moving rows is a permutation, whose adjoint is its inverse, so the
//! backward pass takes the reverse path: the gradients of the returned rows are packed and go
//! out as the rows did, and those of the dispatched rows come back and are unpacked. Rows are
//! copied, never added: the exchange itself changes no bits.
//!
//! **The rest of the axis.** The expert axis is carved out of the data axis: the other
//! parameters are replicated (or FSDP-sharded) over the data ranks as without it, and an
//! expert's gradients are summed over [`Mesh::expert_replicas`], the data ranks that hold the
//! same experts.
//!
//! [`Mesh::expert_group`]: super::mesh::Mesh::expert_group
//! [`Mesh::expert_replicas`]: super::mesh::Mesh::expert_replicas

use std::ops::Range;

use super::comm::Collectives;
use crate::backend::{Backend, BufKind, IdxView, Parts, View};
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
    /// The counts' exchange: this member's rows of each of the model's experts (`L` for each
    /// member), then what each member sent this one's experts.
    counts: View,
}

impl ExpertExchange {
    /// This device's part in `group` (its expert group, in expert-axis order) for `experts`
    /// experts, which the group's size divides (checked with the mesh:
    /// [`super::mesh::Mesh::check_model`]).
    pub fn new<B: Backend>(be: &mut B, group: Vec<usize>, rank: usize, experts: usize) -> ExpertExchange {
        let n = group.len();
        assert!(experts.is_multiple_of(n), "internal error: {experts} experts over an expert group of {n}");
        let me = group.iter().position(|&r| r == rank).expect("internal error: a rank outside its expert group");
        let counts = be.alloc(BufKind::Scalars, 2 * experts);
        ExpertExchange { group, me, local: experts / n, counts }
    }

    /// The experts this device holds.
    pub fn local_experts(&self) -> Range<usize> {
        self.me * self.local..(self.me + 1) * self.local
    }

    /// Moves `input`'s part `j` to member `j`; `output`'s part `s` receives member `s`'s part
    /// for this one: the dispatch of packed rows, and their return.
    pub fn exchange<B: Backend>(
        &mut self,
        comm: &mut (impl Collectives<B> + ?Sized),
        be: &mut B,
        input: View,
        output: View,
    ) {
        comm.all_to_all(be, input, output, &self.group);
    }

    /// Writes into `runs` the runs of the rows this member receives in `parts` (each sender's
    /// `L + 1` offsets), from `offsets` (the rows of each of the model's experts on this
    /// member): the counts travel between the devices alone.
    pub fn runs<B: Backend>(
        &mut self,
        comm: &mut (impl Collectives<B> + ?Sized),
        be: &mut B,
        offsets: IdxView,
        parts: Parts,
        runs: IdxView,
    ) {
        let e = self.group.len() * self.local;
        assert_eq!((parts.members, parts.local), (self.group.len(), self.local), "internal error: parts {parts:?}");
        let (mine, theirs) = (self.counts.at(0, e), self.counts.at(e, e));
        be.moe_counts(mine, offsets);
        comm.all_to_all(be, mine, theirs, &self.group);
        be.moe_runs(runs, theirs, parts);
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

    /// Every device of 4 packs its rows into parts, dispatches them over its expert group
    /// (`groups` of 2 or 4), applies its experts run by run to what it received, and gives the
    /// results back; each finds its own rows' results where its rows were, and what it received
    /// is what its experts were sent, zeros after each sender's rows.
    fn exchange_over(groups: fn(usize) -> Vec<usize>) {
        crate::parallel::comm::tests::on_devices(4, move |rank: usize, comm: &mut Virtual, be: &mut Cpu| {
            let group = groups(rank);
            let n = group.len();
            let mut ex = ExpertExchange::new(be, group.clone(), rank, EXPERTS);
            let counts: Vec<usize> = (0..EXPERTS).map(|e| routed(rank, e)).collect();
            let rows: Vec<f32> = (0..EXPERTS).flat_map(|e| (0..counts[e]).flat_map(move |i| row(rank, e, i))).collect();
            let mut at = vec![0u32];
            counts.iter().for_each(|&c| at.push(at.last().unwrap() + c as u32));
            // Parts as large as the most a member can send one member: 3 rows of each expert.
            let parts = Parts { members: n, local: EXPERTS / n, rows: 3 * EXPERTS / n };
            let size = n * parts.rows * WIDTH;
            let offsets = be.alloc_idx(EXPERTS + 1);
            be.upload_idx(offsets, &at);
            let [input, packed, received, back] = [0; 4].map(|_| be.alloc(BufKind::Activations, size));
            be.upload(input.at(0, rows.len()), &rows);
            be.moe_pack(packed, input, offsets, parts, WIDTH);
            ex.exchange(comm, be, packed, received);
            let runs = be.alloc_idx(n * (parts.local + 1));
            ex.runs(comm, be, offsets, parts, runs);
            let mut got = vec![0f32; size];
            be.download(received, &mut got);
            let mut table = vec![0u32; runs.len];
            be.download_idx(runs, &mut table);
            // What arrived: each sender's rows for each of this device's experts, in order,
            // then zeros; the runs find each expert's.
            let local = ex.local_experts();
            let mut want = Vec::new();
            for (s, &sender) in group.iter().enumerate() {
                let mut part: Vec<f32> =
                    local.clone().flat_map(|e| (0..routed(sender, e)).flat_map(move |i| row(sender, e, i))).collect();
                let mut start = (s * parts.rows) as u32;
                assert_eq!(table[s * (parts.local + 1)], start, "rank {rank}: sender {sender}'s first run");
                for (l, e) in local.clone().enumerate() {
                    start += routed(sender, e) as u32;
                    assert_eq!(table[s * (parts.local + 1) + l + 1], start, "rank {rank}: sender {sender}, expert {e}");
                }
                part.resize(parts.rows * WIDTH, 0.0);
                want.extend(part);
            }
            assert_eq!(got, want, "rank {rank}: the parts dispatched to it");
            // The experts applied, run by run, and the results given back.
            let mut out = vec![0f32; size];
            for s in 0..n {
                for l in 0..parts.local {
                    let run = table[s * (parts.local + 1) + l] as usize..table[s * (parts.local + 1) + l + 1] as usize;
                    for r in run {
                        let y = apply(local.start + l, &got[r * WIDTH..(r + 1) * WIDTH]);
                        out[r * WIDTH..(r + 1) * WIDTH].copy_from_slice(&y);
                    }
                }
            }
            be.upload(received, &out);
            ex.exchange(comm, be, received, packed);
            be.moe_unpack(back, packed, offsets, parts, WIDTH);
            let mut results = vec![0f32; rows.len()];
            be.download(back.at(0, rows.len()), &mut results);
            let want: Vec<f32> =
                (0..EXPERTS).flat_map(|e| (0..counts[e]).flat_map(move |i| apply(e, &row(rank, e, i)))).collect();
            assert_eq!(results, want, "rank {rank}: its rows' results, back where its rows were");
        });
    }

    #[test]
    fn rows_reach_their_experts_and_come_back_in_place() {
        exchange_over(|_| vec![0, 1, 2, 3]);
        exchange_over(|rank| if rank < 2 { vec![0, 1] } else { vec![2, 3] });
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
