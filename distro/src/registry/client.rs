//! The HTTP side of the registry client: auth handshakes, redirects, retries, byte counts.
//!
//! Redirects are followed by hand (reqwest's automatic policy is off) so the rule is ours and
//! tested: the `Authorization` header goes only to the registry's own origin (scheme, host and
//! port); a redirect to a blob store elsewhere gets no credentials. Plain HTTP is used only for
//! loopback registries and those named with `--insecure`.
use super::auth::{Challenge, Credential, Credentials, Scope, parse_challenges};
use crate::retry::Policy;
use anyhow::{Context, Result, anyhow, bail};
use reqwest::Method;
use reqwest::blocking::{Body, Response};
use std::collections::HashMap;
use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use url::Url;

/// Counters for what a client moved; `distro push` reports them.
#[derive(Debug, Default)]
pub struct Stats {
    /// Blob bytes sent in upload bodies (0 when re-pushing an unchanged image).
    pub blob_bytes_sent: AtomicU64,
    /// Blobs uploaded (neither present nor mounted).
    pub blobs_uploaded: AtomicU64,
    /// Blobs the registry already had (HEAD said so).
    pub blobs_present: AtomicU64,
    /// Blobs mounted from another repository of the same registry.
    pub blobs_mounted: AtomicU64,
    /// Bytes of manifests and indexes sent.
    pub manifest_bytes_sent: AtomicU64,
    /// Bytes received in blob downloads.
    pub blob_bytes_received: AtomicU64,
}

impl Stats {
    /// Reads one of the counters above.
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// A request body that can be produced again for a retry.
#[derive(Clone)]
pub enum Payload {
    /// No body (GET, HEAD, DELETE, and upload session starts).
    Empty,
    /// Bytes held in memory (manifests, small chunks).
    Bytes(Arc<Vec<u8>>),
    /// A byte range of a file (blobs are too large to hold in memory).
    File {
        /// The file holding the bytes.
        path: PathBuf,
        /// Where the range starts in the file.
        offset: u64,
        /// How many bytes the range holds.
        len: u64,
    },
}

impl Payload {
    fn len(&self) -> u64 {
        match self {
            Payload::Empty => 0,
            Payload::Bytes(b) => b.len() as u64,
            Payload::File { len, .. } => *len,
        }
    }
    fn body(&self, progress: Option<&indicatif::ProgressBar>) -> Result<Option<Body>> {
        Ok(match self {
            Payload::Empty => None,
            Payload::Bytes(b) => Some(Body::from(b.as_ref().clone())),
            Payload::File { path, offset, len } => {
                use std::io::{Seek, SeekFrom};
                let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
                f.seek(SeekFrom::Start(*offset))?;
                let reader = Counting { inner: f.take(*len), progress: progress.cloned() };
                Some(Body::sized(reader, *len))
            }
        })
    }
}

struct Counting<R> {
    inner: R,
    progress: Option<indicatif::ProgressBar>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        if let Some(p) = &self.progress {
            p.inc(n as u64);
        }
        Ok(n)
    }
}

/// One registry request.
pub struct Request {
    /// HTTP method.
    pub method: Method,
    /// Absolute URL.
    pub url: Url,
    /// Token scopes this request needs (Bearer registries).
    pub scopes: Vec<Scope>,
    /// Headers besides `Authorization`, which the client adds itself.
    pub headers: Vec<(&'static str, String)>,
    /// Body, reproducible for retries and redirects.
    pub body: Payload,
    /// Whether the body is blob data (counted in [`Stats::blob_bytes_sent`]).
    pub blob_body: bool,
}

impl Request {
    /// A request without body.
    pub fn new(method: Method, url: Url, scopes: Vec<Scope>) -> Request {
        Request { method, url, scopes, headers: Vec::new(), body: Payload::Empty, blob_body: false }
    }
    /// Adds header `name: value`.
    pub fn header(mut self, name: &'static str, value: impl Into<String>) -> Request {
        self.headers.push((name, value.into()));
        self
    }
    /// Sets the body.
    pub fn body(mut self, body: Payload, is_blob: bool) -> Request {
        self.body = body;
        self.blob_body = is_blob;
        self
    }
}

#[derive(Clone, Debug, Default)]
enum AuthScheme {
    /// Not yet challenged; requests go out without credentials.
    #[default]
    Unknown,
    Basic,
    Bearer {
        realm: String,
        service: Option<String>,
    },
}

#[derive(Default)]
struct HostState {
    scheme: AuthScheme,
    tokens: HashMap<String, String>,
}

/// A registry client: one HTTP connection pool, cached tokens per host, and byte counters.
pub struct Client {
    http: reqwest::blocking::Client,
    creds: Credentials,
    insecure: Vec<String>,
    hosts: Mutex<HashMap<String, HostState>>,
    /// What this client moved.
    pub stats: Stats,
    /// Retry policy for transient failures (connection errors, 429, 5xx).
    pub retry: Policy,
    /// Progress bar that upload bodies advance, if any.
    pub progress: Mutex<Option<indicatif::ProgressBar>>,
}

/// True for `localhost`, `127.0.0.0/8` and `::1`, with or without a port.
pub fn is_loopback(host: &str) -> bool {
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        return ip.is_loopback();
    }
    let h = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or(rest)
    } else {
        host.rsplit_once(':').map(|(h, p)| if p.bytes().all(|b| b.is_ascii_digit()) { h } else { host }).unwrap_or(host)
    };
    h == "localhost" || h == "::1" || h.parse::<std::net::Ipv4Addr>().is_ok_and(|ip| ip.is_loopback())
}

/// Whether two URLs share an origin (scheme, host, port): the only case where credentials may
/// follow a redirect.
pub fn same_origin(a: &Url, b: &Url) -> bool {
    a.scheme() == b.scheme() && a.host_str() == b.host_str() && a.port_or_known_default() == b.port_or_known_default()
}

fn install_crypto_provider() {
    // Several clients may race to install; the first wins and the rest are fine with it.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl Client {
    /// A client using `creds`; `insecure` lists registries reachable over plain HTTP besides
    /// loopback ones.
    pub fn new(creds: Credentials, insecure: Vec<String>) -> Result<Client> {
        install_crypto_provider();
        let http = reqwest::blocking::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(30))
            .timeout(None)
            .user_agent(concat!("distro/", env!("CARGO_PKG_VERSION")))
            .build()
            .context("creating the HTTP client")?;
        Ok(Client {
            http,
            creds,
            insecure,
            hosts: Mutex::new(HashMap::new()),
            stats: Stats::default(),
            retry: Policy::default(),
            progress: Mutex::new(None),
        })
    }

    /// Whether `host` may be spoken to over plain HTTP.
    pub fn plain_http_allowed(&self, host: &str) -> bool {
        is_loopback(host) || self.insecure.iter().any(|h| h == host)
    }

    /// `https://host` (or `http://host` for loopback/insecure registries).
    pub fn base_url(&self, host: &str) -> Result<Url> {
        let scheme = if self.plain_http_allowed(host) { "http" } else { "https" };
        Url::parse(&format!("{scheme}://{host}/")).map_err(|e| anyhow!("registry host {host:?}: {e}"))
    }

    /// `<base>/v2/<repository>/<rest>`.
    pub fn api_url(&self, host: &str, repository: &str, rest: &str) -> Result<Url> {
        Ok(self.base_url(host)?.join(&format!("v2/{repository}/{rest}"))?)
    }

    /// Sends `req` to registry `host`: authenticates on a 401 challenge (once), follows
    /// redirects (credentials only within the registry's origin) and retries transient
    /// failures with backoff. Returns the final response, whatever its status.
    pub fn send(&self, host: &str, req: &Request) -> Result<Response> {
        let origin = self.base_url(host)?;
        let mut attempt = 0u32;
        let mut challenged = false;
        loop {
            attempt += 1;
            let auth = self.auth_header(host, &req.scopes)?;
            let result = self.send_following_redirects(&origin, req, auth.as_deref());
            match result {
                Err(e) if attempt < self.retry.attempts && is_transient(&e) => {
                    let wait = self.retry.delay(attempt, None);
                    tracing::warn!("{} {}: {e:#}; retrying in {wait:?}", req.method, req.url);
                    std::thread::sleep(wait);
                }
                Err(e) => {
                    return Err(e).with_context(|| format!("{} {}", req.method, redact(&req.url)));
                }
                Ok(resp) if resp.status() == 401 && !challenged => {
                    challenged = true;
                    attempt -= 1; // an auth round-trip is not a failure
                    self.handle_challenge(host, &resp, &req.scopes)?;
                }
                Ok(resp) if resp.status() == 401 => {
                    let found = self.creds.lookup(host)?;
                    let what = match found {
                        Some(f) => {
                            format!("the registry rejected the credentials from {}", f.origin)
                        }
                        None => no_credentials_hint(host),
                    };
                    bail!("{host}: authentication failed: {what} ({})", error_text(resp));
                }
                Ok(resp) if is_retryable_status(resp.status().as_u16()) && attempt < self.retry.attempts => {
                    let wait = self.retry.delay(attempt, retry_after(&resp));
                    tracing::warn!("{} {}: HTTP {}; retrying in {wait:?}", req.method, redact(&req.url), resp.status());
                    std::thread::sleep(wait);
                }
                Ok(resp) => return Ok(resp),
            }
        }
    }

    fn send_following_redirects(&self, origin: &Url, req: &Request, auth: Option<&str>) -> Result<Response> {
        let mut url = req.url.clone();
        let mut method = req.method.clone();
        let mut body = req.body.clone();
        for _ in 0..10 {
            let mut b = self.http.request(method.clone(), url.clone());
            for (k, v) in &req.headers {
                b = b.header(*k, v);
            }
            if let Some(a) = auth
                && same_origin(origin, &url)
            {
                b = b.header("Authorization", a);
            }
            let progress = self.progress.lock().expect("progress lock").clone();
            if let Some(payload) = body.body(if req.blob_body { progress.as_ref() } else { None })? {
                b = b.header("Content-Length", body.len().to_string()).body(payload);
            } else if method == Method::PUT || method == Method::POST || method == Method::PATCH {
                b = b.header("Content-Length", "0");
            }
            let resp = b.send()?;
            if req.blob_body {
                self.stats.blob_bytes_sent.fetch_add(body.len(), Ordering::Relaxed);
            }
            let status = resp.status().as_u16();
            if !matches!(status, 301 | 302 | 303 | 307 | 308) {
                return Ok(resp);
            }
            let Some(loc) = resp.headers().get("location").and_then(|v| v.to_str().ok()) else {
                return Ok(resp);
            };
            let next = url.join(loc).with_context(|| format!("bad redirect Location {loc:?}"))?;
            if next.scheme() == "http" && url.scheme() == "https" {
                bail!("refusing a redirect from https to plain http ({})", redact(&next));
            }
            // 303, and 301/302 after a POST, turn into a GET without body (as browsers do).
            if status == 303 || (matches!(status, 301 | 302) && method == Method::POST) {
                method = Method::GET;
                body = Payload::Empty;
            }
            url = next;
        }
        bail!("too many redirects from {}", redact(&req.url))
    }

    /// The `Authorization` value for a request to `host` with `scopes`, fetching a token when
    /// the registry is known to use Bearer auth.
    fn auth_header(&self, host: &str, scopes: &[Scope]) -> Result<Option<String>> {
        let scheme = self.hosts.lock().expect("hosts lock").entry(host.to_string()).or_default().scheme.clone();
        match scheme {
            AuthScheme::Unknown => Ok(None),
            AuthScheme::Basic => Ok(self.creds.lookup(host)?.and_then(|f| f.credential.basic_header())),
            AuthScheme::Bearer { realm, service } => {
                let key = scope_key(scopes);
                if let Some(t) = self.hosts.lock().expect("hosts lock").get(host).and_then(|s| s.tokens.get(&key)) {
                    return Ok(Some(format!("Bearer {t}")));
                }
                let token = self.fetch_token(host, &realm, service.as_deref(), scopes)?;
                let mut hosts = self.hosts.lock().expect("hosts lock");
                hosts.entry(host.to_string()).or_default().tokens.insert(key, token.clone());
                Ok(Some(format!("Bearer {token}")))
            }
        }
    }

    fn handle_challenge(&self, host: &str, resp: &Response, scopes: &[Scope]) -> Result<()> {
        let challenges: Vec<Challenge> = resp
            .headers()
            .get_all("www-authenticate")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(parse_challenges)
            .collect();
        let bearer = challenges.iter().find(|c| c.scheme == "bearer");
        let basic = challenges.iter().any(|c| c.scheme == "basic");
        let mut hosts = self.hosts.lock().expect("hosts lock");
        let state = hosts.entry(host.to_string()).or_default();
        if let Some(b) = bearer {
            let realm =
                b.params.get("realm").cloned().ok_or_else(|| anyhow!("{host}: Bearer challenge without realm"))?;
            let service = b.params.get("service").cloned();
            state.scheme = AuthScheme::Bearer { realm: realm.clone(), service: service.clone() };
            drop(hosts);
            // The challenge may ask for more than we planned (e.g. pull on a mount source).
            let mut wanted = scopes.to_vec();
            if let Some(s) = b.params.get("scope") {
                wanted.extend(Scope::parse_list(s));
            }
            let token = self.fetch_token(host, &realm, service.as_deref(), &Scope::merge(wanted))?;
            let mut hosts = self.hosts.lock().expect("hosts lock");
            hosts.entry(host.to_string()).or_default().tokens.insert(scope_key(scopes), token);
            Ok(())
        } else if basic {
            state.scheme = AuthScheme::Basic;
            drop(hosts);
            match self.creds.lookup(host)? {
                Some(f) if f.credential.basic_header().is_some() => Ok(()),
                Some(f) => bail!("{host} wants Basic auth but the credential from {} is a token", f.origin),
                None => bail!("{host}: authentication required: {}", no_credentials_hint(host)),
            }
        } else {
            bail!("{host}: HTTP 401 without a usable WWW-Authenticate challenge")
        }
    }

    fn fetch_token(&self, host: &str, realm: &str, service: Option<&str>, scopes: &[Scope]) -> Result<String> {
        let realm_url = Url::parse(realm).with_context(|| format!("{host}: token realm {realm:?} is not a URL"))?;
        let found = self.creds.lookup(host)?;
        let realm_host = realm_url.host_str().unwrap_or("").to_string();
        let realm_hostport = match realm_url.port() {
            Some(p) => format!("{realm_host}:{p}"),
            None => realm_host.clone(),
        };
        if found.is_some() && realm_url.scheme() != "https" && !self.plain_http_allowed(&realm_hostport) {
            bail!("{host}: refusing to send credentials to a token realm over plain http ({realm_host})");
        }
        let mut req = match found.as_ref().map(|f| &f.credential) {
            Some(Credential::Registry(t)) => return Ok(t.clone()),
            Some(Credential::Identity(refresh)) => {
                let mut form = url::form_urlencoded::Serializer::new(String::new());
                form.append_pair("grant_type", "refresh_token").append_pair("refresh_token", refresh);
                form.append_pair("client_id", "distro");
                if let Some(s) = service {
                    form.append_pair("service", s);
                }
                let scope: Vec<String> = scopes.iter().map(|s| s.to_string()).collect();
                form.append_pair("scope", &scope.join(" "));
                Request::new(Method::POST, realm_url.clone(), vec![])
                    .header("Content-Type", "application/x-www-form-urlencoded")
                    .body(Payload::Bytes(Arc::new(form.finish().into_bytes())), false)
            }
            _ => {
                let mut u = realm_url.clone();
                {
                    let mut q = u.query_pairs_mut();
                    if let Some(s) = service {
                        q.append_pair("service", s);
                    }
                    for s in scopes {
                        q.append_pair("scope", &s.to_string());
                    }
                }
                Request::new(Method::GET, u, vec![])
            }
        };
        let basic = found.as_ref().and_then(|f| f.credential.basic_header());
        req.headers.push(("Accept", "application/json".into()));
        let mut attempt = 0;
        let resp = loop {
            attempt += 1;
            match self.send_following_redirects(&realm_url, &req, basic.as_deref()) {
                Ok(r) if is_retryable_status(r.status().as_u16()) && attempt < self.retry.attempts => {
                    std::thread::sleep(self.retry.delay(attempt, retry_after(&r)));
                }
                Err(e) if is_transient(&e) && attempt < self.retry.attempts => {
                    std::thread::sleep(self.retry.delay(attempt, None));
                }
                other => {
                    break other.with_context(|| format!("{host}: getting a token from {realm_host}"))?;
                }
            }
        };
        let status = resp.status();
        if status == 401 || status == 403 {
            let why = match &found {
                Some(f) => format!("the token service rejected the credentials from {}", f.origin),
                None => no_credentials_hint(host),
            };
            bail!("{host}: authentication failed at {realm_host}: {why}");
        }
        if !status.is_success() {
            bail!("{host}: token service {realm_host} answered HTTP {status}");
        }
        #[derive(serde::Deserialize)]
        struct TokenReply {
            #[serde(default)]
            token: Option<String>,
            #[serde(default)]
            access_token: Option<String>,
        }
        let bytes = resp.bytes().with_context(|| format!("{host}: reading the token reply from {realm_host}"))?;
        let reply: TokenReply = serde_json::from_slice(&bytes)
            .with_context(|| format!("{host}: the token reply from {realm_host} is not JSON"))?;
        reply
            .token
            .or(reply.access_token)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| anyhow!("{host}: token service {realm_host} returned no token"))
    }
}

fn scope_key(scopes: &[Scope]) -> String {
    Scope::merge(scopes.iter().cloned()).iter().map(|s| s.to_string()).collect::<Vec<_>>().join(" ")
}

fn no_credentials_hint(host: &str) -> String {
    format!(
        "no credentials found for {host} (run `docker login {host}`, or set {} and {})",
        super::auth::ENV_USER,
        super::auth::ENV_PASSWORD
    )
}

fn is_retryable_status(s: u16) -> bool {
    matches!(s, 408 | 429 | 500 | 502 | 503 | 504)
}

/// `e` as a [`crate::error::Transient`] (exit 75) when it is a fault of the connection that
/// outlived the retries, its cause kept in the message; any other error unchanged. For commands
/// whose callers (the nightly) may simply run them again later.
pub fn mark_transient(e: anyhow::Error) -> anyhow::Error {
    if is_transient(&e) {
        let cause = crate::error::one_line(&e);
        crate::error::Transient(format!("the registry cannot be reached ({cause}); try again later")).into()
    } else {
        e
    }
}

/// Whether `e` is a fault of the connection (refused, timed out, cut), which may pass.
fn is_transient(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<reqwest::Error>()
            .is_some_and(|r| r.is_connect() || r.is_timeout() || r.is_request() || r.is_body())
    })
}

fn retry_after(resp: &Response) -> Option<Duration> {
    let v = resp.headers().get("retry-after")?.to_str().ok()?;
    v.trim().parse::<u64>().ok().map(|s| Duration::from_secs(s.min(30)))
}

/// A URL without its query (upload locations carry opaque state; signed blob URLs carry keys).
pub fn redact(url: &Url) -> String {
    let mut u = url.clone();
    u.set_query(None);
    u.to_string()
}

/// A one-line description of a failed response: status plus the registry's error codes.
pub fn error_text(resp: Response) -> String {
    let status = resp.status();
    let body = resp.text().unwrap_or_default();
    #[derive(serde::Deserialize)]
    struct Errors {
        errors: Vec<ErrorItem>,
    }
    #[derive(serde::Deserialize)]
    struct ErrorItem {
        #[serde(default)]
        code: String,
        #[serde(default)]
        message: String,
    }
    match serde_json::from_str::<Errors>(&body) {
        Ok(e) if !e.errors.is_empty() => {
            let parts: Vec<String> = e.errors.iter().map(|i| format!("{}: {}", i.code, i.message)).collect();
            format!("HTTP {status}: {}", parts.join("; "))
        }
        _ => {
            let snippet: String = body.chars().take(200).collect();
            let snippet = snippet.split_whitespace().collect::<Vec<_>>().join(" ");
            if snippet.is_empty() { format!("HTTP {status}") } else { format!("HTTP {status}: {snippet}") }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registry_that_refuses_connections_is_a_transient_fault_and_a_refusal_is_not() {
        let mut client = Client::new(Credentials::default(), vec![]).unwrap();
        client.retry = Policy { attempts: 1, ..Policy::default() };
        // Port 9 (discard) on loopback: nothing listens there.
        let e = client.list_tags(&crate::registry::reference::Reference::parse("127.0.0.1:9/x").unwrap()).unwrap_err();
        let e = mark_transient(e);
        assert_eq!(crate::error::exit_code(&e), 75, "{e:#}");
        assert!(
            crate::error::one_line(&e)
                .starts_with("the registry cannot be reached (GET http://127.0.0.1:9/v2/x/tags/list"),
            "{e:#}"
        );
        assert_eq!(crate::error::exit_code(&mark_transient(anyhow::anyhow!("HTTP 403"))), 1);
    }

    #[test]
    fn loopback_detection() {
        for h in ["localhost", "localhost:5000", "127.0.0.1:5000", "127.1.2.3", "[::1]:5000", "::1"] {
            assert!(is_loopback(h), "{h}");
        }
        for h in ["ghcr.io", "10.0.0.1:5000", "localhost.evil.com", "128.0.0.1"] {
            assert!(!is_loopback(h), "{h}");
        }
    }

    #[test]
    fn credentials_stay_within_origin() {
        let reg = Url::parse("https://ghcr.io/").unwrap();
        assert!(same_origin(&reg, &Url::parse("https://ghcr.io/v2/x/blobs/sha256:1").unwrap()));
        assert!(same_origin(&reg, &Url::parse("https://ghcr.io:443/v2/").unwrap()));
        assert!(!same_origin(&reg, &Url::parse("https://pkg-containers.githubusercontent.com/ghcr1/blobs").unwrap()));
        assert!(!same_origin(&reg, &Url::parse("http://ghcr.io/v2/").unwrap()));
        assert!(!same_origin(&reg, &Url::parse("https://ghcr.io:8443/v2/").unwrap()));
    }

    #[test]
    fn redaction_drops_query() {
        let u = Url::parse("https://s3.example/blob?X-Amz-Signature=secret&x=1").unwrap();
        assert_eq!(redact(&u), "https://s3.example/blob");
    }
}
