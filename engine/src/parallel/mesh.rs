//! The device mesh: how ranks map onto the data, fsdp, tensor, pipeline and seq axes.
//!
//! Each axis has an intra-node (`ici`) and an inter-node (`dcn`) size; the axis size is their
//! product. Ranks are numbered node by node (`rank = node · devices_per_node + local_rank`).
//! Inside a node the tensor axis varies fastest, then seq, then fsdp, then data, then pipeline,
//! so that the chattiest collectives (tensor parallelism, then the sequence axis's gathers of
//! keys and values) stay between neighbouring devices and pipeline
//! stages (point-to-point only) are the farthest apart; across nodes the same order applies to
//! the node index, and an axis's global coordinate is `dcn_coordinate · ici_size +
//! ici_coordinate`.
//!
//! Batch semantics follow Pax and MaxText: the global batch is `train.batch_size` × devices,
//! whatever the strategy. Data and fsdp ranks read disjoint samples; the devices of a tensor
//! group, of a pipeline and of a seq group share theirs, so each pipeline × tensor × seq group
//! reads `batch_size · tensor · pipeline · seq` sequences per micro-batch (a seq rank keeps two
//! chunks of each).

use anyhow::{Result, anyhow, bail};

use crate::config::{MeshConfig, ModelConfig};

/// The four parallel axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Axis {
    /// Replicas that all-reduce gradients.
    Data,
    /// Replicas that shard parameters, gradients and optimizer state.
    Fsdp,
    /// Devices that split heads, MLP columns and experts.
    Tensor,
    /// Stages that each hold a contiguous run of layers and pass activations on.
    Pipeline,
    /// Devices that split each sequence into chunks (context parallelism).
    Seq,
}

/// Axes, in the index order of [`Mesh::ici`] and [`Mesh::dcn`].
const AXES: usize = 5;

/// A resolved mesh for a given number of nodes and devices per node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mesh {
    /// Intra-node sizes `[data, fsdp, tensor, pipeline, seq]`.
    pub ici: [usize; AXES],
    /// Inter-node sizes `[data, fsdp, tensor, pipeline, seq]`.
    pub dcn: [usize; AXES],
    /// The expert axis's `[intra-node, inter-node]` sizes, which divide the data axis's: the
    /// expert axis is carved out of the data ranks ([`Mesh::expert_group`]).
    pub expert: [usize; 2],
}

/// A rank's coordinates on the five axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coords {
    /// Position on the data axis.
    pub data: usize,
    /// Position on the fsdp axis.
    pub fsdp: usize,
    /// Position on the tensor axis.
    pub tensor: usize,
    /// Position on the pipeline axis: the stage.
    pub pipeline: usize,
    /// Position on the seq axis: which chunks of each sequence.
    pub seq: usize,
}

impl Coords {
    fn get(&self, a: usize) -> usize {
        [self.data, self.fsdp, self.tensor, self.pipeline, self.seq][a]
    }
}

const NAMES: [&str; AXES] = ["data", "fsdp", "tensor", "pipeline", "seq"];
/// Axis indices from outermost to innermost within a node and across nodes.
const ORDER: [usize; AXES] = [3, 0, 1, 4, 2];

impl Mesh {
    /// The single-device mesh.
    pub fn single() -> Mesh {
        Mesh { ici: [1; AXES], dcn: [1; AXES], expert: [1, 1] }
    }

    /// Resolves the configured sizes for `nodes` nodes of `devices_per_node` devices, filling a
    /// -1 in each group. Errors spell out the arithmetic.
    pub fn resolve(cfg: &MeshConfig, devices_per_node: usize, nodes: usize) -> Result<Mesh> {
        let ici = [cfg.ici_data, cfg.ici_fsdp, cfg.ici_tensor, cfg.ici_pipeline, cfg.ici_seq];
        let dcn = [cfg.dcn_data, cfg.dcn_fsdp, cfg.dcn_tensor, cfg.dcn_pipeline, cfg.dcn_seq];
        let ici = fill("ici", ici, devices_per_node, "devices per node")?;
        let dcn = fill("dcn", dcn, nodes, "nodes")?;
        let mut expert = [1; 2];
        for (i, (group, size, data)) in
            [("ici", cfg.ici_expert, ici[0]), ("dcn", cfg.dcn_expert, dcn[0])].into_iter().enumerate()
        {
            if size < 1 {
                bail!("mesh.{group}_expert = {size}: the expert axis's size is a positive number (1: no expert axis)");
            }
            let size = size as usize;
            if !data.is_multiple_of(size) {
                bail!(
                    "mesh.{group}_expert = {size} does not divide mesh.{group}_data = {data}: the expert axis is carved out of the data axis (each group of {size} data ranks holds every expert once); {data} mod {size} = {}",
                    data % size
                );
            }
            expert[i] = size;
        }
        Ok(Mesh { ici, dcn, expert })
    }

    /// Size of the expert axis (intra-node × inter-node): how many devices divide the experts
    /// among them.
    pub fn expert_size(&self) -> usize {
        self.expert[0] * self.expert[1]
    }

    /// A data coordinate's place on the expert axis and among the replicas of one expert
    /// group: `(expert, replica)`. Within a node, consecutive data ranks form an expert group,
    /// so that the all-to-all stays inside the node when `dcn_expert` is 1; across nodes,
    /// consecutive nodes do.
    fn expert_coords(&self, data: usize) -> (usize, usize) {
        let (ici, dcn) = (data % self.ici[0], data / self.ici[0]);
        let [ie, de] = self.expert;
        ((dcn % de) * ie + ici % ie, (dcn / de) * (self.ici[0] / ie) + ici / ie)
    }

    /// The expert group of `rank`, in expert-axis order: the ranks of its data group that hold
    /// every expert once between them, and exchange tokens by all-to-all. The member at
    /// position `i` holds experts `[i·E/n, (i+1)·E/n)` of `E`.
    pub fn expert_group(&self, rank: usize) -> Vec<usize> {
        let data = self.group(rank, Axis::Data);
        let (_, replica) = self.expert_coords(self.coords(rank).data);
        let mut members: Vec<(usize, usize)> = (0..data.len())
            .map(|x| (self.expert_coords(x), data[x]))
            .filter(|((_, r), _)| *r == replica)
            .map(|((e, _), rank)| (e, rank))
            .collect();
        members.sort();
        members.into_iter().map(|(_, r)| r).collect()
    }

    /// The experts `rank` holds of a model of `experts`: all of them without an expert axis,
    /// else its expert group position's share, `[i·E/n, (i+1)·E/n)`.
    pub fn held_experts(&self, rank: usize, experts: usize) -> std::ops::Range<usize> {
        let n = self.expert_size();
        let (member, _) = self.expert_coords(self.coords(rank).data);
        member * experts / n..(member + 1) * experts / n
    }

    /// `rank`'s place among the replicas of its expert group: 0 for the first data ranks that
    /// hold every expert once between them (every data rank's own index without an expert axis).
    pub fn expert_replica(&self, rank: usize) -> usize {
        self.expert_coords(self.coords(rank).data).1
    }

    /// The ranks of `rank`'s data group that hold the same experts as it, in data-axis order:
    /// the experts' gradients are summed over them (the other parameters' over the whole data
    /// group).
    pub fn expert_replicas(&self, rank: usize) -> Vec<usize> {
        let data = self.group(rank, Axis::Data);
        let (expert, _) = self.expert_coords(self.coords(rank).data);
        (0..data.len()).filter(|&x| self.expert_coords(x).0 == expert).map(|x| data[x]).collect()
    }

    /// Size of an axis (intra-node × inter-node).
    pub fn size(&self, axis: Axis) -> usize {
        let i = axis as usize;
        self.ici[i] * self.dcn[i]
    }

    /// Devices per node.
    pub fn devices_per_node(&self) -> usize {
        self.ici.iter().product()
    }

    /// Total devices.
    pub fn devices(&self) -> usize {
        self.devices_per_node() * self.dcn.iter().product::<usize>()
    }

    /// Ranks that read distinct samples: data × fsdp.
    pub fn batch_shards(&self) -> usize {
        self.size(Axis::Data) * self.size(Axis::Fsdp)
    }

    /// The coordinates of a global rank.
    pub fn coords(&self, rank: usize) -> Coords {
        let per_node = self.devices_per_node();
        let (node, local) = (rank / per_node, rank % per_node);
        // Innermost axis first.
        let split = |mut index: usize, sizes: [usize; AXES]| {
            let mut at = [0; AXES];
            for &a in ORDER.iter().rev() {
                at[a] = index % sizes[a];
                index /= sizes[a];
            }
            at
        };
        let (i, d) = (split(local, self.ici), split(node, self.dcn));
        let axis = |a: usize| d[a] * self.ici[a] + i[a];
        Coords { data: axis(0), fsdp: axis(1), tensor: axis(2), pipeline: axis(3), seq: axis(4) }
    }

    /// The global rank at some coordinates (the inverse of [`Mesh::coords`]).
    pub fn rank(&self, c: Coords) -> usize {
        let (mut local, mut node) = (0, 0);
        for a in ORDER {
            let at = c.get(a);
            local = local * self.ici[a] + at % self.ici[a];
            node = node * self.dcn[a] + at / self.ici[a];
        }
        node * self.devices_per_node() + local
    }

    /// The ranks that share every coordinate with `rank` but `axis`, in axis order: the group a
    /// collective over that axis runs in.
    pub fn group(&self, rank: usize, axis: Axis) -> Vec<usize> {
        let c = self.coords(rank);
        (0..self.size(axis))
            .map(|k| {
                let mut g = c;
                match axis {
                    Axis::Data => g.data = k,
                    Axis::Fsdp => g.fsdp = k,
                    Axis::Tensor => g.tensor = k,
                    Axis::Pipeline => g.pipeline = k,
                    Axis::Seq => g.seq = k,
                }
                self.rank(g)
            })
            .collect()
    }

    /// The ranks that share every coordinate with `rank` but those of `axes`, in rank order.
    pub fn group_over(&self, rank: usize, axes: &[Axis]) -> Vec<usize> {
        let c = self.coords(rank);
        let free = |a: usize| axes.iter().any(|&x| x as usize == a);
        (0..self.devices())
            .filter(|&r| {
                let o = self.coords(r);
                (0..AXES).all(|a| free(a) || o.get(a) == c.get(a))
            })
            .collect()
    }

    /// Checks that the model splits evenly over the tensor axis and into the pipeline's stages.
    pub fn check_model(&self, m: &ModelConfig) -> Result<()> {
        let ep = self.expert_size();
        let axis = || format!("ici_expert x dcn_expert = {} x {}", self.expert[0], self.expert[1]);
        match &m.moe {
            None if ep > 1 => bail!(
                "mesh: the expert axis has {} = {ep} devices, but the model is dense (model.moe is not set): there are no experts to distribute; set mesh.ici_expert and mesh.dcn_expert to 1",
                axis()
            ),
            Some(moe) if !moe.num_experts.is_multiple_of(ep) => bail!(
                "mesh: the expert axis has {} = {ep} devices, which does not divide model.moe.num_experts = {} (each device holds whole experts); {} mod {ep} = {}",
                axis(),
                moe.num_experts,
                moe.num_experts,
                moe.num_experts % ep
            ),
            _ => {}
        }
        let pp = self.size(Axis::Pipeline);
        if pp > 1 && pp > m.n_layers {
            bail!(
                "mesh: the pipeline axis has {} = {pp} stages, more than model.n_layers = {} (each stage holds at least one layer)",
                describe_axis(self, 3),
                m.n_layers
            );
        }
        if pp > 1 && m.tie_embeddings {
            bail!(
                "mesh: the pipeline axis has {} = {pp} stages, but model.tie_embeddings = true: the embedding (first stage) and the output head (last stage) would be one tensor on two devices, which this engine does not split; untie them or train without stages",
                describe_axis(self, 3)
            );
        }
        let tp = self.size(Axis::Tensor);
        if tp == 1 {
            return Ok(());
        }
        let mut must_divide = vec![
            ("model.n_heads", m.n_heads, "each tensor-parallel device takes whole query heads"),
            ("model.n_kv_heads", m.n_kv_heads, "each tensor-parallel device takes whole key/value heads"),
        ];
        let what = if m.moe.is_some() {
            "each device takes a slice of every expert's MLP columns"
        } else {
            "each device takes a slice of the MLP's columns"
        };
        must_divide.push(("model.mlp_dim", m.mlp_dim, what));
        if let Some(moe) = m.moe.as_ref().filter(|moe| !moe.dense_layers.is_empty()) {
            must_divide.push((
                "model.moe.dense_mlp_dim",
                moe.dense_mlp_dim,
                "each device takes a slice of the dense layers' columns",
            ));
        }
        must_divide.push((
            "model.vocab_size",
            m.vocab_size,
            "vocabulary parallelism: each device takes a slice of the embedding's rows and of the output head's",
        ));
        for (key, value, why) in must_divide {
            if value % tp != 0 {
                bail!(
                    "mesh: the tensor axis has {} = {tp} devices, which does not divide {key} = {value} ({why}); {value} mod {tp} = {}",
                    describe_axis(self, 2),
                    value % tp
                );
            }
        }
        Ok(())
    }
}

/// `ici_tensor x dcn_tensor = 2 x 1`, for messages.
fn describe_axis(mesh: &Mesh, a: usize) -> String {
    format!("ici_{0} x dcn_{0} = {1} x {2}", NAMES[a], mesh.ici[a], mesh.dcn[a])
}

/// Resolves one group of sizes whose product must be `total`, filling at most one -1.
fn fill(group: &str, sizes: [i64; AXES], total: usize, what: &str) -> Result<[usize; AXES]> {
    let keys: Vec<String> = NAMES.iter().map(|n| format!("mesh.{group}_{n}")).collect();
    for (key, &s) in keys.iter().zip(&sizes) {
        if s == 0 || s < -1 {
            bail!("{key} = {s}: a mesh size is a positive number, or -1 to fill");
        }
    }
    let fills: Vec<usize> = (0..AXES).filter(|&i| sizes[i] == -1).collect();
    let known: usize = sizes.iter().filter(|&&s| s > 0).map(|&s| s as usize).product();
    let product = sizes.iter().map(|s| if *s == -1 { "-1".to_string() } else { s.to_string() }).collect::<Vec<_>>();
    let formula = format!("{} = {}", keys.join(" x "), product.join(" x "));
    match fills.as_slice() {
        [] if known == total => Ok(sizes.map(|s| s as usize)),
        [] => Err(anyhow!(
            "{formula} = {known}, but there are {total} {what}: the {group} sizes must multiply to the {what} (or set one to -1 to fill)"
        )),
        [i] if total.is_multiple_of(known) => {
            let mut out = sizes.map(|s| s.max(1) as usize);
            out[*i] = total / known;
            Ok(out)
        }
        [i] => Err(anyhow!(
            "{formula}: the known sizes multiply to {known}, which does not divide the {total} {what}, so {} = -1 cannot fill it",
            keys[*i]
        )),
        _ => Err(anyhow!("{formula}: at most one {group} size may be -1")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(ici: [i64; 3], dcn: [i64; 3]) -> MeshConfig {
        MeshConfig {
            ici_data: ici[0],
            ici_fsdp: ici[1],
            ici_tensor: ici[2],
            ici_pipeline: 1,
            dcn_data: dcn[0],
            dcn_fsdp: dcn[1],
            dcn_tensor: dcn[2],
            dcn_pipeline: 1,
            ..MeshConfig::default()
        }
    }

    #[test]
    fn fills_and_spells_out_the_arithmetic() {
        let m = Mesh::resolve(&cfg([-1, 2, 2], [-1, 1, 1]), 8, 4).unwrap();
        assert_eq!((m.ici, m.dcn, m.devices()), ([2, 2, 2, 1, 1], [4, 1, 1, 1, 1], 32));
        assert_eq!((m.size(Axis::Data), m.batch_shards()), (8, 16));
        let e = Mesh::resolve(&cfg([2, 2, 1], [1, 1, 1]), 8, 1).unwrap_err().to_string();
        assert!(
            e.contains(
                "mesh.ici_data x mesh.ici_fsdp x mesh.ici_tensor x mesh.ici_pipeline x mesh.ici_seq = 2 x 2 x 1 x 1 x 1 = 4, but there are 8 devices per node"
            ),
            "{e}"
        );
        let e = Mesh::resolve(&cfg([-1, 3, 1], [1, 1, 1]), 8, 1).unwrap_err().to_string();
        assert!(
            e.contains("multiply to 3, which does not divide the 8 devices per node, so mesh.ici_data = -1"),
            "{e}"
        );
        assert!(Mesh::resolve(&cfg([-1, -1, 1], [1, 1, 1]), 8, 1).unwrap_err().to_string().contains("at most one"));
        assert!(Mesh::resolve(&cfg([0, 1, 1], [1, 1, 1]), 1, 1).unwrap_err().to_string().contains("mesh.ici_data = 0"));
        let e = Mesh::resolve(&cfg([8, 1, 1], [-1, 1, 1]), 8, 1).map(|m| m.dcn).unwrap();
        assert_eq!(e, [1, 1, 1, 1, 1]);
    }

    #[test]
    fn pipeline_stages_are_the_outermost_axis() {
        let mesh = MeshConfig { ici_data: 1, ici_fsdp: 2, ici_tensor: 2, ici_pipeline: 2, ..MeshConfig::default() };
        let m = Mesh::resolve(&mesh, 8, 1).unwrap();
        assert_eq!(m.size(Axis::Pipeline), 2);
        let mut seen = std::collections::HashSet::new();
        for r in 0..8 {
            let c = m.coords(r);
            assert_eq!(m.rank(c), r);
            assert!(seen.insert((c.pipeline, c.data, c.fsdp, c.tensor)));
        }
        assert_eq!(m.group(1, Axis::Pipeline), vec![1, 5]);
        assert_eq!(m.group(5, Axis::Tensor), vec![4, 5]);
        assert_eq!(m.group(6, Axis::Fsdp), vec![4, 6]);
        // Across nodes: stage 0 on node 0, stage 1 on node 1.
        let across = MeshConfig { ici_data: 4, dcn_data: 1, dcn_pipeline: 2, ..MeshConfig::default() };
        let m = Mesh::resolve(&across, 4, 2).unwrap();
        assert_eq!(m.group(2, Axis::Pipeline), vec![2, 6]);
    }

    #[test]
    fn ranks_and_coordinates_are_a_bijection_with_tensor_innermost() {
        let m = Mesh::resolve(&cfg([2, 2, 2], [2, 1, 1]), 8, 2).unwrap();
        let mut seen = std::collections::HashSet::new();
        for r in 0..m.devices() {
            let c = m.coords(r);
            assert_eq!(m.rank(c), r);
            assert!(seen.insert((c.data, c.fsdp, c.tensor)));
        }
        // Tensor groups are neighbouring ranks on one node; data groups span nodes.
        assert_eq!(m.group(5, Axis::Tensor), vec![4, 5]);
        assert_eq!(m.group(0, Axis::Fsdp), vec![0, 2]);
        assert_eq!(m.group(0, Axis::Data), vec![0, 4, 8, 12]);
    }

    #[test]
    fn the_model_must_split_over_the_tensor_axis() {
        let m = Mesh::resolve(&cfg([1, 1, 3], [1, 1, 1]), 3, 1).unwrap();
        let model = ModelConfig { n_heads: 8, n_kv_heads: 8, mlp_dim: 96, ..ModelConfig::default() };
        let e = m.check_model(&model).unwrap_err().to_string();
        assert!(e.contains("does not divide model.n_heads = 8") && e.contains("8 mod 3 = 2"), "{e}");
        let ok = ModelConfig { n_heads: 6, n_kv_heads: 3, mlp_dim: 96, vocab_size: 33, ..model };
        assert!(m.check_model(&ok).is_ok());
        let e = m.check_model(&ModelConfig { vocab_size: 32, ..ok }).unwrap_err().to_string();
        assert!(e.contains("does not divide model.vocab_size = 32") && e.contains("32 mod 3 = 2"), "{e}");
    }

    #[test]
    fn the_expert_axis_needs_experts_that_it_divides_and_a_data_axis_it_divides() {
        let mesh = |data: i64, expert: i64| MeshConfig { ici_data: data, ici_expert: expert, ..MeshConfig::default() };
        let e = Mesh::resolve(&mesh(4, 3), 4, 1).unwrap_err().to_string();
        assert!(
            e.contains("mesh.ici_expert = 3 does not divide mesh.ici_data = 4") && e.contains("4 mod 3 = 1"),
            "{e}"
        );
        let e = Mesh::resolve(&mesh(4, 0), 4, 1).unwrap_err().to_string();
        assert!(e.contains("mesh.ici_expert = 0: the expert axis's size is a positive number"), "{e}");
        let m = Mesh::resolve(&mesh(-1, 2), 4, 1).unwrap();
        assert_eq!((m.expert_size(), m.devices()), (2, 4), "the expert axis takes no devices of its own");
        let dense = ModelConfig::default();
        let e = m.check_model(&dense).unwrap_err().to_string();
        assert!(e.contains("ici_expert x dcn_expert = 2 x 1 = 2 devices, but the model is dense"), "{e}");
        let moe = |num_experts| ModelConfig {
            moe: Some(crate::config::MoeConfig { num_experts, top_k: 2, ..Default::default() }),
            ..ModelConfig::default()
        };
        assert!(m.check_model(&moe(8)).is_ok());
        let m = Mesh::resolve(&mesh(-1, 4), 4, 1).unwrap();
        let e = m.check_model(&moe(6)).unwrap_err().to_string();
        assert!(
            e.contains("= 4 devices, which does not divide model.moe.num_experts = 6") && e.contains("6 mod 4 = 2"),
            "{e}"
        );
    }
}
