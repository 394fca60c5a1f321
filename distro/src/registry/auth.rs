//! Registry authentication: `WWW-Authenticate` challenges, token scopes, and where credentials
//! come from (`~/.docker/config.json` with its credential helpers, or the environment).
//!
//! Secrets never reach a log or an error message: [`Credential`]'s `Debug` hides them.
use crate::error::bad_input;
use anyhow::{Context, Result, bail};
use base64::Engine as _;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// One challenge from a `WWW-Authenticate` header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Challenge {
    /// Scheme, lowercased (`bearer`, `basic`).
    pub scheme: String,
    /// Parameters with lowercased names (`realm`, `service`, `scope`, `error`).
    pub params: BTreeMap<String, String>,
}

/// Parses a `WWW-Authenticate` value (RFC 9110 §11.6.1): one or more challenges, each a scheme
/// followed by comma-separated `name=token` or `name="quoted \"string\""` parameters.
pub fn parse_challenges(header: &str) -> Vec<Challenge> {
    let s = header.as_bytes();
    let mut i = 0;
    let mut out: Vec<Challenge> = Vec::new();
    let is_tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~/:".contains(&b);
    let skip = |i: &mut usize, set: &[u8]| {
        while *i < s.len() && set.contains(&s[*i]) {
            *i += 1;
        }
    };
    let token = |i: &mut usize| {
        let start = *i;
        while *i < s.len() && is_tchar(s[*i]) {
            *i += 1;
        }
        String::from_utf8_lossy(&s[start..*i]).into_owned()
    };
    loop {
        skip(&mut i, b" \t,");
        if i >= s.len() {
            break;
        }
        let scheme = token(&mut i);
        if scheme.is_empty() {
            i += 1; // not a token character: skip it rather than loop forever
            continue;
        }
        let mut ch = Challenge { scheme: scheme.to_ascii_lowercase(), params: BTreeMap::new() };
        loop {
            skip(&mut i, b" \t");
            // A parameter is `name =`; anything else starts the next challenge.
            let save = i;
            let name = token(&mut i);
            skip(&mut i, b" \t");
            if name.is_empty() || i >= s.len() || s[i] != b'=' {
                i = save;
                break;
            }
            i += 1;
            skip(&mut i, b" \t");
            let value = if i < s.len() && s[i] == b'"' {
                i += 1;
                let mut v = Vec::new();
                while i < s.len() && s[i] != b'"' {
                    if s[i] == b'\\' && i + 1 < s.len() {
                        i += 1;
                    }
                    v.push(s[i]);
                    i += 1;
                }
                i += 1; // closing quote
                String::from_utf8_lossy(&v).into_owned()
            } else {
                let start = i;
                while i < s.len() && s[i] != b',' && s[i] != b' ' {
                    i += 1;
                }
                String::from_utf8_lossy(&s[start..i]).into_owned()
            };
            ch.params.insert(name.to_ascii_lowercase(), value);
            skip(&mut i, b" \t");
            if i < s.len() && s[i] == b',' {
                i += 1;
            } else {
                break;
            }
        }
        out.push(ch);
    }
    out
}

/// A token scope: `repository:NAME:pull,push` (the name may itself hold `:`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Scope {
    /// Resource type (`repository`, `registry`).
    pub kind: String,
    /// Resource name (`library/debian`).
    pub name: String,
    /// Actions (`pull`, `push`, `*`), sorted.
    pub actions: BTreeSet<String>,
}

impl Scope {
    /// `repository:NAME:ACTIONS`.
    pub fn repository(name: &str, actions: &[&str]) -> Scope {
        Scope { kind: "repository".into(), name: name.into(), actions: actions.iter().map(|a| a.to_string()).collect() }
    }

    /// Parses one scope; `None` when it has no type or no actions.
    pub fn parse(s: &str) -> Option<Scope> {
        let (kind, rest) = s.split_once(':')?;
        let (name, actions) = rest.rsplit_once(':')?;
        if kind.is_empty() || name.is_empty() {
            return None;
        }
        let actions: BTreeSet<String> = actions.split(',').filter(|a| !a.is_empty()).map(String::from).collect();
        Some(Scope { kind: kind.into(), name: name.into(), actions })
    }

    /// Parses a space-separated list (the `scope` parameter may carry several).
    pub fn parse_list(s: &str) -> Vec<Scope> {
        s.split_whitespace().filter_map(Scope::parse).collect()
    }

    /// Merges scopes on the same resource (actions united), in a stable order.
    pub fn merge(scopes: impl IntoIterator<Item = Scope>) -> Vec<Scope> {
        let mut by: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
        for s in scopes {
            by.entry((s.kind, s.name)).or_default().extend(s.actions);
        }
        by.into_iter().map(|((kind, name), actions)| Scope { kind, name, actions }).collect()
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let actions: Vec<&str> = self.actions.iter().map(String::as_str).collect();
        write!(f, "{}:{}:{}", self.kind, self.name, actions.join(","))
    }
}

/// A credential for one registry.
#[derive(Clone, PartialEq, Eq)]
pub enum Credential {
    /// User name and password (or personal access token).
    Basic {
        /// User name sent in the `Basic` header (or to the token service).
        user: String,
        /// Password or personal access token paired with the user name.
        password: String,
    },
    /// An OAuth2 refresh token (`identitytoken`, or a helper's `<token>` user).
    Identity(String),
    /// A ready bearer token for the registry itself (`registrytoken`).
    Registry(String),
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Credential::Basic { user, .. } => write!(f, "Basic({user}:***)"),
            Credential::Identity(_) => f.write_str("Identity(***)"),
            Credential::Registry(_) => f.write_str("Registry(***)"),
        }
    }
}

impl Credential {
    /// The `Authorization: Basic` value, for Basic credentials.
    pub fn basic_header(&self) -> Option<String> {
        match self {
            Credential::Basic { user, password } => Some(format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
            )),
            _ => None,
        }
    }
}

/// A credential and where it came from (the origin is safe to print; the secret is not).
#[derive(Clone, Debug)]
pub struct Found {
    /// The credential found.
    pub credential: Credential,
    /// E.g. `~/.docker/config.json auths`, `docker-credential-pass`, `DISTRO_REGISTRY_USER`.
    pub origin: String,
}

/// `~/.docker/config.json`, the parts that hold credentials.
#[derive(Debug, Default, Deserialize)]
pub struct DockerConfig {
    /// Inline credentials per registry.
    #[serde(default)]
    pub auths: BTreeMap<String, AuthEntry>,
    /// Credential helper per registry (`docker-credential-<name>`).
    #[serde(default, rename = "credHelpers")]
    pub cred_helpers: BTreeMap<String, String>,
    /// Credential helper for every registry without a `credHelpers` entry.
    #[serde(default, rename = "credsStore")]
    pub creds_store: Option<String>,
}

/// One `auths` entry.
#[derive(Default, Deserialize)]
pub struct AuthEntry {
    /// base64 of `user:password`.
    #[serde(default)]
    pub auth: Option<String>,
    /// User name (alternative to `auth`).
    #[serde(default)]
    pub username: Option<String>,
    /// Password (alternative to `auth`).
    #[serde(default)]
    pub password: Option<String>,
    /// OAuth2 refresh token.
    #[serde(default)]
    pub identitytoken: Option<String>,
    /// Bearer token for the registry.
    #[serde(default)]
    pub registrytoken: Option<String>,
}

impl fmt::Debug for AuthEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AuthEntry(***)")
    }
}

/// Docker Hub is stored under its v1 URL in config files and credential helpers.
const DOCKER_HUB_KEY: &str = "https://index.docker.io/v1/";

fn is_docker_hub(host: &str) -> bool {
    matches!(host, "docker.io" | "index.docker.io" | "registry-1.docker.io")
}

/// The host part of a config key (`https://host:5000/v1/` -> `host:5000`).
fn key_host(key: &str) -> &str {
    let k = key.strip_prefix("https://").or_else(|| key.strip_prefix("http://")).unwrap_or(key);
    k.split('/').next().unwrap_or(k)
}

fn key_matches(key: &str, host: &str) -> bool {
    let kh = key_host(key);
    kh == host || (is_docker_hub(kh) && is_docker_hub(host))
}

impl DockerConfig {
    /// Parses config text; `origin` names the file in errors.
    pub fn parse(text: &str, origin: &str) -> Result<DockerConfig> {
        serde_json::from_str(text).map_err(|e| bad_input(format!("{origin}:{}: {e}", e.line())))
    }

    /// Loads `$DOCKER_CONFIG/config.json` or `~/.docker/config.json`; none is fine.
    pub fn load_default() -> Result<Option<DockerConfig>> {
        let Some(path) = Self::default_path() else {
            return Ok(None);
        };
        match std::fs::read_to_string(&path) {
            Ok(text) => Ok(Some(Self::parse(&text, &path.display().to_string())?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
        }
    }

    fn default_path() -> Option<PathBuf> {
        if let Some(dir) = std::env::var_os("DOCKER_CONFIG") {
            return Some(Path::new(&dir).join("config.json"));
        }
        std::env::var_os("HOME").map(|h| Path::new(&h).join(".docker/config.json"))
    }

    /// The helper configured for `host`: its `credHelpers` entry, else `credsStore`.
    pub fn helper_for(&self, host: &str) -> Option<&str> {
        self.cred_helpers
            .iter()
            .find(|(k, _)| key_matches(k, host))
            .map(|(_, v)| v.as_str())
            .or(self.creds_store.as_deref())
            .filter(|h| !h.is_empty())
    }

    /// The inline `auths` credential for `host`.
    pub fn inline_for(&self, host: &str) -> Result<Option<Credential>> {
        let Some((key, e)) = self.auths.iter().find(|(k, _)| key_matches(k, host)) else {
            return Ok(None);
        };
        if let Some(t) = e.registrytoken.as_ref().filter(|t| !t.is_empty()) {
            return Ok(Some(Credential::Registry(t.clone())));
        }
        if let Some(t) = e.identitytoken.as_ref().filter(|t| !t.is_empty()) {
            return Ok(Some(Credential::Identity(t.clone())));
        }
        if let Some(a) = e.auth.as_ref().filter(|a| !a.is_empty()) {
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(a.trim())
                .ok()
                .and_then(|d| String::from_utf8(d).ok())
                .ok_or_else(|| bad_input(format!("docker config: auths.{key}.auth is not base64 of user:password")))?;
            let Some((user, password)) = decoded.split_once(':') else {
                bail!(bad_input(format!("docker config: auths.{key}.auth is not base64 of user:password")));
            };
            return Ok(Some(Credential::Basic { user: user.into(), password: password.into() }));
        }
        match (&e.username, &e.password) {
            (Some(u), Some(p)) if !u.is_empty() => Ok(Some(Credential::Basic { user: u.clone(), password: p.clone() })),
            _ => Ok(None),
        }
    }
}

/// Runs `docker-credential-<helper> get` for `host`.
pub fn run_helper(helper: &str, host: &str) -> Result<Option<Credential>> {
    let server = if is_docker_hub(host) { DOCKER_HUB_KEY.to_string() } else { host.to_string() };
    let program = format!("docker-credential-{helper}");
    let mut child = Command::new(&program)
        .arg("get")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {program} (configured in the docker config)"))?;
    child.stdin.take().expect("piped").write_all(server.as_bytes())?;
    let out = child.wait_with_output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // The helper protocol answers a miss with this message on stdout.
        if stdout.contains("credentials not found") {
            return Ok(None);
        }
        bail!("{program} get failed for {server} ({})", out.status);
    }
    #[derive(Deserialize)]
    struct Reply {
        #[serde(rename = "Username", default)]
        username: String,
        #[serde(rename = "Secret", default)]
        secret: String,
    }
    let r: Reply = serde_json::from_slice(&out.stdout)
        .map_err(|e| anyhow::anyhow!("{program} get returned something that is not its JSON reply: {e}"))?;
    if r.secret.is_empty() {
        return Ok(None);
    }
    Ok(Some(if r.username == "<token>" {
        Credential::Identity(r.secret)
    } else {
        Credential::Basic { user: r.username, password: r.secret }
    }))
}

/// Environment variables for CI: `DISTRO_REGISTRY_USER` and `DISTRO_REGISTRY_PASSWORD`, used for
/// the registry named in `DISTRO_REGISTRY` or, when that is unset, only for the registry being
/// pushed to (so they never reach the base image's registry).
pub const ENV_USER: &str = "DISTRO_REGISTRY_USER";
/// See [`ENV_USER`].
pub const ENV_PASSWORD: &str = "DISTRO_REGISTRY_PASSWORD";
/// See [`ENV_USER`].
pub const ENV_REGISTRY: &str = "DISTRO_REGISTRY";

/// Where credentials come from, in order: environment (for its one registry), the docker
/// config's credential helper for the host, its inline `auths`, then its `credsStore`.
#[derive(Debug, Default)]
pub struct Credentials {
    env: Option<(String, Credential)>,
    config: Option<DockerConfig>,
}

impl Credentials {
    /// Reads the environment and the docker config. `push_host` is the registry the env
    /// credentials apply to when `DISTRO_REGISTRY` is unset.
    pub fn from_environment(push_host: Option<&str>) -> Result<Credentials> {
        let user = std::env::var(ENV_USER).ok().filter(|u| !u.is_empty());
        let password = std::env::var(ENV_PASSWORD).ok();
        let host = std::env::var(ENV_REGISTRY).ok().filter(|h| !h.is_empty()).or(push_host.map(String::from));
        let env = match (user, password, host) {
            (Some(user), Some(password), Some(host)) => Some((host, Credential::Basic { user, password })),
            (Some(_), None, _) => {
                return Err(bad_input(format!("{ENV_USER} is set but {ENV_PASSWORD} is not")));
            }
            _ => None,
        };
        Ok(Credentials { env, config: DockerConfig::load_default()? })
    }

    /// Credentials from explicit parts (tests, embedding).
    pub fn new(env: Option<(String, Credential)>, config: Option<DockerConfig>) -> Credentials {
        Credentials { env, config }
    }

    /// The credential for `host`, if any.
    pub fn lookup(&self, host: &str) -> Result<Option<Found>> {
        if let Some((h, c)) = &self.env
            && key_matches(h, host)
        {
            return Ok(Some(Found { credential: c.clone(), origin: format!("{ENV_USER}/{ENV_PASSWORD}") }));
        }
        let Some(cfg) = &self.config else {
            return Ok(None);
        };
        if let Some((_, helper)) = cfg.cred_helpers.iter().find(|(k, _)| key_matches(k, host)) {
            return Ok(run_helper(helper, host)?
                .map(|credential| Found { credential, origin: format!("docker-credential-{helper}") }));
        }
        if let Some(c) = cfg.inline_for(host)? {
            return Ok(Some(Found { credential: c, origin: "docker config auths".into() }));
        }
        if let Some(helper) = cfg.helper_for(host) {
            return Ok(run_helper(helper, host)?
                .map(|credential| Found { credential, origin: format!("docker-credential-{helper}") }));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docker_hub_challenge() {
        let c = parse_challenges(
            r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/ubuntu:pull""#,
        );
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].scheme, "bearer");
        assert_eq!(c[0].params["realm"], "https://auth.docker.io/token");
        assert_eq!(c[0].params["service"], "registry.docker.io");
        assert_eq!(Scope::parse_list(&c[0].params["scope"]), vec![Scope::repository("library/ubuntu", &["pull"])]);
    }

    #[test]
    fn ghcr_and_nvcr_and_odd_spacing() {
        let c = parse_challenges(
            r#"Bearer realm="https://ghcr.io/token",service="ghcr.io",scope="repository:user/image:pull""#,
        );
        assert_eq!(c[0].params["service"], "ghcr.io");
        // nvcr.io answers with a realm that carries a query-free path and an error param.
        let c = parse_challenges(
            r#"Bearer realm="https://nvcr.io/proxy_auth" , service = "nvcr.io", scope="repository:nvidia/cuda:pull,push", error="insufficient_scope""#,
        );
        assert_eq!(c[0].params["realm"], "https://nvcr.io/proxy_auth");
        assert_eq!(c[0].params["error"], "insufficient_scope");
        assert_eq!(Scope::parse_list(&c[0].params["scope"])[0].actions.len(), 2);
    }

    #[test]
    fn several_challenges_quotes_and_tokens() {
        let c = parse_challenges(r#"Basic realm="Registry \"x\", y", Bearer realm=https://a/t,service=s"#);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].scheme, "basic");
        assert_eq!(c[0].params["realm"], r#"Registry "x", y"#);
        assert_eq!(c[1].params["realm"], "https://a/t");
        assert_eq!(c[1].params["service"], "s");
        assert!(parse_challenges("").is_empty());
        assert_eq!(parse_challenges("Basic").len(), 1);
    }

    #[test]
    fn scopes_parse_and_merge() {
        let s = Scope::parse_list("repository:a/b:pull repository:a/b:push,pull repository:c:pull registry:catalog:*");
        let m = Scope::merge(s);
        let text: Vec<String> = m.iter().map(|s| s.to_string()).collect();
        assert_eq!(text, ["registry:catalog:*", "repository:a/b:pull,push", "repository:c:pull"]);
        // A name holding ':' (e.g. a plugin-qualified type) keeps it.
        let s = Scope::parse("repository(plugin):a:b:pull").unwrap();
        assert_eq!(s.name, "a:b");
        assert!(Scope::parse("nonsense").is_none());
    }

    #[test]
    fn docker_config_forms() {
        let cfg = DockerConfig::parse(
            r#"{
              "auths": {
                "https://index.docker.io/v1/": {"auth": "dXNlcjpwYTpzcw=="},
                "localhost:5000": {"username": "u", "password": "p"},
                "https://ghcr.io": {"identitytoken": "refresh"}
              },
              "credHelpers": {"nvcr.io": "pass"},
              "credsStore": "desktop"
            }"#,
            "config.json",
        )
        .unwrap();
        assert_eq!(
            cfg.inline_for("registry-1.docker.io").unwrap(),
            Some(Credential::Basic { user: "user".into(), password: "pa:ss".into() })
        );
        assert_eq!(
            cfg.inline_for("localhost:5000").unwrap(),
            Some(Credential::Basic { user: "u".into(), password: "p".into() })
        );
        assert_eq!(cfg.inline_for("ghcr.io").unwrap(), Some(Credential::Identity("refresh".into())));
        assert_eq!(cfg.inline_for("localhost:5001").unwrap(), None);
        assert_eq!(cfg.helper_for("nvcr.io"), Some("pass"));
        assert_eq!(cfg.helper_for("quay.io"), Some("desktop"));
        let e = DockerConfig::parse("{\"auths\": {\"x\": {\"auth\": 5}}}", "c.json").unwrap_err();
        assert!(format!("{e}").starts_with("c.json:1:"));
        let bad = DockerConfig::parse(r#"{"auths":{"h":{"auth":"bm9jb2xvbg=="}}}"#, "c").unwrap();
        assert!(bad.inline_for("h").is_err());
    }

    #[test]
    fn secrets_never_in_debug() {
        let c = Credential::Basic { user: "me".into(), password: "hunter2".into() };
        assert!(!format!("{c:?}").contains("hunter2"));
        let f = Found { credential: Credential::Identity("tok123".into()), origin: "x".into() };
        assert!(!format!("{f:?}").contains("tok123"));
        assert_eq!(c.basic_header().unwrap(), "Basic bWU6aHVudGVyMg==");
    }

    #[test]
    fn env_credentials_stay_on_their_host() {
        let creds = Credentials::new(
            Some(("localhost:5000".into(), Credential::Basic { user: "u".into(), password: "p".into() })),
            None,
        );
        assert!(creds.lookup("localhost:5000").unwrap().is_some());
        assert!(creds.lookup("nvcr.io").unwrap().is_none());
    }

    #[test]
    fn credential_helper_protocol() {
        // A real helper program on PATH speaking the docker-credential protocol.
        let dir = tempfile::tempdir().unwrap();
        let helper = dir.path().join("docker-credential-fake");
        std::fs::write(
            &helper,
            "#!/bin/sh\nread host\nif [ \"$host\" = reg.example ]; then echo '{\"ServerURL\":\"reg.example\",\"Username\":\"bob\",\"Secret\":\"s3\"}'; \
             elif [ \"$host\" = tok.example ]; then echo '{\"Username\":\"<token>\",\"Secret\":\"rt\"}'; \
             else echo 'credentials not found in native keychain'; exit 1; fi\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&helper, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = format!("{}:{}", dir.path().display(), std::env::var("PATH").unwrap_or_default());
        // SAFETY: tests in this module that read PATH tolerate the extra directory.
        unsafe { std::env::set_var("PATH", path) };
        assert_eq!(
            run_helper("fake", "reg.example").unwrap(),
            Some(Credential::Basic { user: "bob".into(), password: "s3".into() })
        );
        assert_eq!(run_helper("fake", "tok.example").unwrap(), Some(Credential::Identity("rt".into())));
        assert_eq!(run_helper("fake", "other.example").unwrap(), None);
        assert!(run_helper("missing-helper-xyz", "reg.example").is_err());
    }
}
