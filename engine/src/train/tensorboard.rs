//! TensorBoard event files: the scalars of every step, readable by TensorBoard itself.
//!
//! An event file is a sequence of TFRecords, each `length (u64) | masked CRC32C of the length
//! (u32) | data | masked CRC32C of the data (u32)`, little-endian, where the mask is
//! `((crc >> 15) | (crc << 17)) + 0xa282ead8`. Each record's data is an `Event` protobuf
//! (tensorflow/core/util/event.proto): the first holds `file_version = "brain.Event:2"`, the
//! others a wall time, a step and a `Summary` of `(tag, simple_value)` pairs. The few fields
//! needed are encoded by hand.
//!
//! A resumed run writes a new file that starts with a `SessionLog` START at the first step it
//! runs: TensorBoard then drops the points the interrupted run logged after its checkpoint.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};

/// Writes one event file.
pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// Creates `dir/events.out.tfevents.SECONDS.HOST.PID` and writes its version record.
    /// TensorBoard reads a directory's event files in name order, so SECONDS is made larger
    /// than that of any file already there (a resumed run may start within the same second).
    pub fn create(dir: &Path) -> Result<EventWriter> {
        const PREFIX: &str = "events.out.tfevents.";
        let latest = std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .filter_map(|n| n.strip_prefix(PREFIX)?.split('.').next()?.parse::<u64>().ok())
                    .max()
            })
            .ok()
            .flatten();
        let seconds = (now().trunc() as u64).max(latest.map_or(0, |l| l + 1));
        let name = format!("{PREFIX}{seconds}.{}.{}", hostname(), std::process::id());
        let path = dir.join(name);
        let file = File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut w = EventWriter { path, out: BufWriter::new(file) };
        let mut event = event_header(now(), 0);
        bytes_field(&mut event, 3, b"brain.Event:2");
        w.record(&event)?;
        Ok(w)
    }

    /// The file written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Marks a (re)start at `step`: TensorBoard discards earlier-logged points at `step` or later.
    pub fn session_start(&mut self, step: u64) -> Result<()> {
        let mut event = event_header(now(), step);
        let mut log = Vec::new();
        varint_field(&mut log, 1, 1); // status = START
        bytes_field(&mut event, 7, &log); // Event.session_log
        self.record(&event)
    }

    /// Writes the scalars of one step as one event.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        let mut summary = Vec::new();
        for (tag, value) in values {
            let mut v = Vec::new();
            bytes_field(&mut v, 1, tag.as_bytes());
            key(&mut v, 2, 5);
            v.extend_from_slice(&(*value as f32).to_le_bytes());
            bytes_field(&mut summary, 1, &v);
        }
        let mut event = event_header(now(), step);
        bytes_field(&mut event, 5, &summary);
        self.record(&event)
    }

    /// Appends one TFRecord and flushes it, so a killed run keeps every step it logged.
    fn record(&mut self, data: &[u8]) -> Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut rec = Vec::with_capacity(data.len() + 16);
        rec.extend_from_slice(&len);
        rec.extend_from_slice(&masked_crc(&len).to_le_bytes());
        rec.extend_from_slice(data);
        rec.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.out.write_all(&rec)?;
        self.out.flush().with_context(|| format!("cannot write {}", self.path.display()))
    }
}

/// TFRecord's checksum: CRC32C, rotated and offset so that CRCs of CRCs stay well mixed.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// An `Event` with `wall_time` (field 1, double) and `step` (field 2, int64).
fn event_header(wall_time: f64, step: u64) -> Vec<u8> {
    let mut e = Vec::new();
    key(&mut e, 1, 1);
    e.extend_from_slice(&wall_time.to_le_bytes());
    varint_field(&mut e, 2, step);
    e
}

fn key(out: &mut Vec<u8>, field: u32, wire: u8) {
    varint(out, ((field as u64) << 3) | wire as u64);
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn varint_field(out: &mut Vec<u8>, field: u32, v: u64) {
    key(out, field, 0);
    varint(out, v);
}

fn bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    key(out, field, 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes into the buffer.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let name = if ok {
        String::from_utf8_lossy(&buf[..buf.iter().position(|&b| b == 0).unwrap_or(0)]).into_owned()
    } else {
        String::new()
    };
    let clean: String = name.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '.').collect();
    if clean.is_empty() { "localhost".into() } else { clean }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_masked_crc_matches_tensorflows() {
        // CRC32C("123456789") = 0xe3069283 (the standard check value).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        // TensorFlow's masking of it, computed by hand.
        assert_eq!(masked_crc(b"123456789"), 0x2507_c60du32.wrapping_add(0xa282_ead8));
    }

    #[test]
    fn records_are_framed_and_checksummed() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(3, &[("loss", 2.5)]).unwrap();
        let bytes = std::fs::read(w.path()).unwrap();
        let mut rest = &bytes[..];
        let mut records = Vec::new();
        while !rest.is_empty() {
            let len = u64::from_le_bytes(rest[..8].try_into().unwrap()) as usize;
            assert_eq!(u32::from_le_bytes(rest[8..12].try_into().unwrap()), masked_crc(&rest[..8]));
            let data = &rest[12..12 + len];
            assert_eq!(u32::from_le_bytes(rest[12 + len..16 + len].try_into().unwrap()), masked_crc(data));
            records.push(data.to_vec());
            rest = &rest[16 + len..];
        }
        assert_eq!(records.len(), 2);
        assert!(records[0].windows(13).any(|w| w == b"brain.Event:2"));
        assert!(
            records[1].windows(4).any(|w| w == b"loss") && records[1].windows(4).any(|w| w == 2.5f32.to_le_bytes())
        );
    }
}
