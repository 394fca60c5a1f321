//! The memory plan of one device of a mesh: the model's estimate ([`crate::model::memory`]) for
//! the device's tensor-parallel slice and its share of the batch, with the strategies' own
//! buffers. It follows what [`super::strategies::Parallel`] allocates ([`fsdp_sizes`]): under
//! FSDP a device keeps its pieces of the parameters, gradients and moments, and the buffers it
//! lends the passes for the units in use (gathered parameters, gradients being accumulated), but
//! never the whole model.

use super::mesh::{Axis, Mesh};
use super::strategies::{FsdpOptions, fsdp_sizes};
use super::tensor::local_config;
use crate::backend::BufKind;
use crate::config::Config;
use crate::model::Model;
use crate::model::memory::{self, Estimate, Target, element_bytes};

/// Bytes one device of `mesh` holds to train `config` on `target`, by what holds them.
pub fn estimate(config: &Config, mesh: &Mesh, target: Target) -> Estimate {
    let tensor = mesh.size(Axis::Tensor);
    let mut model = Model::new(&local_config(&config.model, tensor));
    model.remat = config.train.remat;
    // The devices of a tensor group share their samples: `batch_size · tensor` each.
    let mut e = memory::estimate(&model, config.train.batch_size.per_group(tensor), config.train.seq_len, target);
    let fsdp = mesh.size(Axis::Fsdp);
    if fsdp > 1 {
        let f = fsdp_sizes(&model.layout, fsdp, FsdpOptions::of(&config.mesh));
        let bytes = |kind| element_bytes(kind, target);
        e.parameters = (f.shard + f.gathered) * bytes(BufKind::Params);
        e.gradients = (f.shard + f.accumulating) * bytes(BufKind::Grads);
        e.optimizer = 2 * f.shard * bytes(BufKind::OptState);
    }
    e
}
