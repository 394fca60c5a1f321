//! `distro verify IMAGE`: fetches the SBOM and provenance attached to a pushed index and checks
//! them against the image; prints one line per mismatch (exit 1), or one line saying what was
//! verified.
use super::parse_ref;
use crate::error::bad_input;
use crate::oci::manifest::is_index;
use crate::oci::store::BlobStore;
use crate::provenance::{Attached, INTOTO_TYPE, PLATFORM_ANNOTATION, SBOM_TYPE, Subject, check, referrers};
use crate::registry::auth::Credentials;
use crate::registry::client::Client;
use anyhow::{Result, bail};
use clap::Args;
use serde_json::Value;
use std::process::ExitCode;

/// The arguments of `distro verify`.
#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// The pushed index, by tag or digest (REPO:TAG or REPO@DIGEST).
    #[arg(value_name = "IMAGE")]
    pub image: String,
    /// Registry reachable over plain HTTP (loopback registries always are).
    #[arg(long, value_name = "HOST[:PORT]", value_parser = super::registry_host)]
    pub insecure: Vec<String>,
}

/// Runs `distro verify`.
pub fn verify_cmd(a: VerifyArgs) -> Result<ExitCode> {
    let r = parse_ref(&a.image, "IMAGE")?;
    if r.tag.is_none() && r.digest.is_none() {
        return Err(bad_input(format!("IMAGE {}: name the index by tag or digest (REPO:TAG or REPO@DIGEST)", a.image)));
    }
    let client = Client::new(Credentials::from_environment(Some(r.api_host()))?, a.insecure)?;
    let top = client.fetch_manifest(&r)?;
    if !is_index(&top.media_type) {
        return Err(bad_input(format!("{r} is a single image manifest; distro verify checks an index distro pushed")));
    }
    let scratch = tempfile::tempdir()?;
    let store = BlobStore::new(scratch.path());
    let subject = Subject::read(
        &top.media_type,
        &top.bytes,
        |d| Ok(client.fetch_manifest(&r.with_digest(&d.digest))?.bytes),
        |d| {
            if !store.has(&d.digest) {
                client.fetch_blob(&r, &d.digest, Some(d.size), &store)?;
            }
            Ok(store.path(&d.digest))
        },
    )?;
    let (entries, how) = referrers::list(&client, &r, &top.digest)?;
    let mut attached = Attached::default();
    for e in &entries {
        let kind = e["artifactType"].as_str().unwrap_or("");
        if kind != SBOM_TYPE && kind != INTOTO_TYPE {
            continue;
        }
        let Some(d) = e["digest"].as_str().and_then(|d| crate::oci::digest::Digest::parse(d).ok()) else { continue };
        let m = client.fetch_manifest(&r.with_digest(&d))?;
        let v: Value = serde_json::from_slice(&m.bytes)?;
        if v["subject"]["digest"] != top.digest.as_str() {
            bail!("{}: referrer {d} names another subject, {}", r.name(), v["subject"]["digest"]);
        }
        for l in v["layers"].as_array().into_iter().flatten() {
            let Ok(ld) = serde_json::from_value::<crate::oci::manifest::Descriptor>(l.clone()) else { continue };
            client.fetch_blob(&r, &ld.digest, Some(ld.size), &store)?;
            let bytes = store.read(&ld.digest)?;
            if kind == SBOM_TYPE {
                attached.sbom_artifact = true;
                let p = l["annotations"][PLATFORM_ANNOTATION].as_str().unwrap_or("unknown").to_owned();
                attached.sboms.insert(p, bytes);
            } else {
                attached.statements.push(bytes);
            }
        }
    }
    let mismatches = check(&subject, &attached);
    for m in &mismatches {
        println!("{m}");
    }
    if !mismatches.is_empty() {
        bail!(
            "{r} ({}): {} mismatch(es) between the image and what is attached to it ({how})",
            top.digest,
            mismatches.len()
        );
    }
    println!(
        "verified {r} ({}): SBOM of {} platform(s), {} provenance statement(s), found through the {how}",
        top.digest,
        attached.sboms.len(),
        attached.statements.len()
    );
    Ok(ExitCode::SUCCESS)
}
