//! `distro sign IMAGE --key KEY.pem`: signs a pushed index with an ECDSA P-256 key the way cosign
//! does ([`crate::provenance::signature`]): cosign's tag `sha256-HEX.sig`, which `cosign verify
//! --key` reads, and the same manifest as a referrer, beside the SBOM. Prints one line saying
//! what was signed and where the signature went; exit 75 when the registry cannot be reached.
use super::parse_index_ref;
use crate::error::bad_input;
use crate::oci::bundle::ManifestDoc;
use crate::oci::digest::Digest;
use crate::oci::manifest::{Descriptor, OCI_MANIFEST, is_index};
use crate::oci::store::BlobStore;
use crate::progress::Progress;
use crate::provenance::referrers::attach;
use crate::provenance::signature::{
    Found, SIMPLE_SIGNING_TYPE, SigningKey, cosign_tag, identity, payload, signature_artifact, signature_layer,
    signature_layers,
};
use crate::registry::auth::{Credentials, Scope};
use crate::registry::client::{Client, mark_transient};
use crate::registry::push::{PushOptions, PushPlan, push};
use anyhow::Result;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use clap::Args;
use serde_json::Value;
use std::path::PathBuf;
use std::process::ExitCode;

/// The arguments of `distro sign`.
#[derive(Args, Debug)]
pub struct SignArgs {
    /// The pushed index, by tag or digest (REPO:TAG or REPO@DIGEST).
    #[arg(value_name = "IMAGE")]
    pub image: String,
    /// ECDSA P-256 private key, PEM, PKCS#8, unencrypted (as `openssl genpkey -algorithm EC -pkeyopt
    /// ec_paramgen_curve:P-256` writes it).
    #[arg(long, value_name = "KEY.pem")]
    pub key: PathBuf,
    /// Registry reachable over plain HTTP (loopback registries always are).
    #[arg(long, value_name = "HOST[:PORT]", value_parser = super::registry_host)]
    pub insecure: Vec<String>,
}

/// Runs `distro sign`.
pub fn sign_cmd(a: SignArgs) -> Result<ExitCode> {
    let r = parse_index_ref(&a.image)?;
    // The key first: a bad one is refused before anything is fetched or sent.
    let key = SigningKey::load(&a.key)?;
    let key_name = a.key.display().to_string();
    let client = Client::new(Credentials::from_environment(Some(r.api_host()))?, a.insecure)?;
    let top = client.fetch_manifest(&r).map_err(mark_transient)?;
    if !is_index(&top.media_type) {
        return Err(bad_input(format!("{r} is a single image manifest; distro sign signs the index distro pushed")));
    }
    let index = Descriptor::of(&top.media_type, &top.bytes);
    let tag = cosign_tag(&top.digest);
    let p = payload(&identity(&r), &top.digest);
    let scratch = tempfile::tempdir()?;
    let store = BlobStore::new(scratch.path());

    // Signatures already there (cosign's, another key's, an earlier run's) are kept, as cosign
    // keeps them; one of this key over this payload makes signing again a no-op.
    let mut layers: Vec<Value> = Vec::new();
    let scopes = vec![Scope::repository(&r.repository, &["pull"])];
    if client.manifest_digest(&r.with_tag(&tag), scopes).map_err(mark_transient)?.is_some() {
        let m = client.fetch_manifest(&r.with_tag(&tag)).map_err(mark_transient)?;
        let v: Value = serde_json::from_slice(&m.bytes).unwrap_or_default();
        layers.extend(
            v["layers"].as_array().into_iter().flatten().filter(|l| l["mediaType"] == SIMPLE_SIGNING_TYPE).cloned(),
        );
        let ours = Digest::of(&p);
        let public = key.public_key();
        for (d, signature) in signature_layers(&m.bytes).into_iter().filter(|(d, _)| d.digest == ours) {
            let found = Found { payload: p.clone(), signature, source: format!("tag {tag}") };
            if found.made_by(&public) {
                println!(
                    "{r} ({}) is already signed with {key_name}: tag {tag} holds it (layer {}); nothing sent",
                    top.digest, d.digest
                );
                return Ok(ExitCode::SUCCESS);
            }
        }
    }
    let signature = STANDARD.encode(key.sign(&p)?);
    layers.push(signature_layer(&p, &signature));
    let artifact = signature_artifact(&index, &layers, &p);
    let doc = ManifestDoc::new(OCI_MANIFEST, artifact.manifest.clone());
    // The referrer first (it pushes the blobs and the manifest), then cosign's tag on it.
    let how = attach(&client, &r, &top.digest, std::slice::from_ref(&artifact), &store, &Progress::new())
        .map_err(mark_transient)?;
    let plan = PushPlan { tags: [(tag.clone(), doc.clone())].into(), ..PushPlan::default() };
    push(&client, &r, &plan, &PushOptions::default(), &Progress::new()).map_err(mark_transient)?;
    println!(
        "signed {r} ({}) with {key_name}: signature manifest {} tagged {tag} (cosign's scheme) and attached as a referrer through the {how}",
        top.digest, doc.digest
    );
    Ok(ExitCode::SUCCESS)
}
