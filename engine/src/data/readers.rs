//! The documents of one input file, streamed, whatever form the corpus is published in.
//!
//! The name says how to read a file: a compression suffix (`.gz`, `.zst`/`.zstd`, `.bz2`) is
//! undone while reading, then `.jsonl` and `.json` are JSON lines (one object per line, the
//! document in its `--text-field`), `.parquet` and `.arrow` are a column of strings, and any
//! other file is plain text (one document, or documents between separator lines). Nothing is
//! decompressed to disk or held whole: lines are read in pieces of at most [`PART_BYTES`] (a
//! JSON line, which is parsed whole, is refused past [`MAX_JSON_LINE`]), Parquet pages and Arrow
//! record batches one at a time, and a long document is handed on in parts of about
//! [`PART_BYTES`] cut at seams that do not change its tokens ([`seam`]). Errors name the file and
//! the line or row.

use std::borrow::Cow;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, Visitor};

use super::arrow_ipc;

/// A long document is handed on in parts of about this many bytes; lines are read in pieces
/// of at most this many.
pub const PART_BYTES: usize = 64 << 10;

/// The longest JSON line read: a line is parsed whole, so a longer one (a decompression bomb
/// expands to a single line of any length) is refused rather than held in memory.
pub const MAX_JSON_LINE: usize = 32 << 20;

/// How to read the inputs.
#[derive(Debug, Clone)]
pub struct ReadOptions {
    /// In plain-text files, a line equal to this separates documents.
    pub separator: Option<String>,
    /// The field (JSON lines) or column (Parquet, Arrow) holding the text.
    pub text_field: String,
    /// Hand long documents on in parts of about this many bytes, cut at [`seam`]s; none: whole.
    pub part_bytes: Option<usize>,
}

/// A document, or a part of one: the document ends with the part whose `last` is set.
#[derive(Debug)]
pub struct Part {
    /// The text.
    pub text: String,
    /// Whether the document ends here.
    pub last: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compression {
    None,
    Gzip,
    Zstd,
    Bzip2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Jsonl,
    Parquet,
    Arrow,
    Text,
}

fn kind(path: &Path) -> (Compression, Format) {
    let name = path.file_name().map(|n| n.to_string_lossy().to_lowercase()).unwrap_or_default();
    let (compression, inner) = [(".gz", Compression::Gzip), (".zst", Compression::Zstd), (".zstd", Compression::Zstd)]
        .into_iter()
        .chain([(".bz2", Compression::Bzip2)])
        .find_map(|(suffix, c)| name.strip_suffix(suffix).map(|inner| (c, inner.to_owned())))
        .unwrap_or((Compression::None, name));
    let format = match inner.rsplit_once('.').map(|(_, ext)| ext) {
        Some("jsonl" | "json") => Format::Jsonl,
        Some("parquet") => Format::Parquet,
        Some("arrow") => Format::Arrow,
        _ => Format::Text,
    };
    (compression, format)
}

/// Counts the bytes read from the file, for the progress bar.
struct Counted<'a, R> {
    inner: R,
    progress: &'a (dyn Fn(u64) + Sync),
}

impl<R: Read> Read for Counted<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        (self.progress)(n as u64);
        Ok(n)
    }
}

/// A zstd stream of one or more frames (`zstd` and `pzstd` write several), skipping the
/// skippable frames between them (`pzstd` writes one before each frame, holding its size).
struct Zstd<R: BufRead> {
    decoder: Option<ruzstd::decoding::StreamingDecoder<Frame<R>, ruzstd::decoding::FrameDecoder>>,
}

/// A frame's source: its magic number, read to tell skippable frames apart, then the rest.
type Frame<R> = std::io::Chain<std::io::Cursor<[u8; 4]>, R>;

/// The magic numbers of skippable frames: `0x184d2a50` to `0x184d2a5f`.
const SKIPPABLE: std::ops::RangeInclusive<u32> = 0x184d_2a50..=0x184d_2a5f;

impl<R: BufRead> Zstd<R> {
    fn new(source: R) -> std::io::Result<Self> {
        let decoder = Self::frame(source, ruzstd::decoding::FrameDecoder::new())?;
        if decoder.is_none() {
            return Err(zstd_error(&"the data ends before a zstd frame begins (an empty or truncated file?)"));
        }
        Ok(Zstd { decoder })
    }

    /// The decoder of the next frame, past any skippable ones; none at the end of the data.
    fn frame(
        mut source: R,
        frames: ruzstd::decoding::FrameDecoder,
    ) -> std::io::Result<Option<ruzstd::decoding::StreamingDecoder<Frame<R>, ruzstd::decoding::FrameDecoder>>> {
        let truncated = |e: std::io::Error| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => zstd_error(&"the data ends inside a frame's header (truncated?)"),
            _ => e,
        };
        loop {
            if source.fill_buf()?.is_empty() {
                return Ok(None);
            }
            let mut magic = [0u8; 4];
            source.read_exact(&mut magic).map_err(truncated)?;
            let number = u32::from_le_bytes(magic);
            if !SKIPPABLE.contains(&number) {
                let frame = std::io::Cursor::new(magic).chain(source);
                return ruzstd::decoding::StreamingDecoder::new_with_decoder(frame, frames).map(Some).map_err(|e| {
                    use ruzstd::decoding::errors::{FrameDecoderError as Error, ReadFrameHeaderError as Header};
                    match e {
                        Error::ReadFrameHeaderError(Header::BadMagicNumber(m)) => zstd_error(&format_args!(
                            "a frame begins with 0x{m:08x}, not zstd's magic number 0xfd2fb528"
                        )),
                        Error::ReadFrameHeaderError(_) | Error::FrameHeaderError(_) => {
                            zstd_error(&"a frame's header is damaged or truncated")
                        }
                        // ruzstd's own text, a sentence for the other errors at a frame's start.
                        other => zstd_error(&other),
                    }
                });
            }
            let mut length = [0u8; 4];
            source.read_exact(&mut length).map_err(truncated)?;
            let length = u32::from_le_bytes(length) as u64;
            if std::io::copy(&mut (&mut source).take(length), &mut std::io::sink())? != length {
                return Err(zstd_error(&"the data ends inside a skippable frame (truncated?)"));
            }
        }
    }
}

/// An error of the zstd data, in a sentence: ruzstd's `Display` of a frame header error is
/// Rust's debug text (`MagicNumberReadError(Error { kind: UnexpectedEof, ... })`).
fn zstd_error(text: &dyn std::fmt::Display) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, text.to_string())
}

impl<R: BufRead> Read for Zstd<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let Some(decoder) = self.decoder.as_mut() else { return Ok(0) };
            let n = decoder.read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            // The frame is over: another one, or the end.
            let (frame, frames) = self.decoder.take().expect("present").into_parts();
            self.decoder = Self::frame(frame.into_inner().1, frames)?;
        }
    }
}

/// Reads one input file's documents, handing them to `emit` (long ones in parts), and the bytes
/// read from the file to `progress`. Errors name the file and the line or row.
pub fn read_file(
    path: &Path,
    opts: &ReadOptions,
    progress: &(dyn Fn(u64) + Sync),
    emit: &mut dyn FnMut(Part) -> Result<()>,
) -> Result<()> {
    let (compression, format) = kind(path);
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    if format == Format::Parquet {
        if compression != Compression::None {
            bail!("{}: a compressed Parquet file cannot be read as a stream; decompress it first", path.display());
        }
        return read_parquet(path, file, opts, progress, emit);
    }
    let counted = BufReader::with_capacity(1 << 20, Counted { inner: file, progress });
    let open_error = |e: std::io::Error| anyhow!("{}: not {} data: {e}", path.display(), name(compression));
    let mut reader: Box<dyn BufRead> = match compression {
        Compression::None => Box::new(counted),
        Compression::Gzip => Box::new(BufReader::with_capacity(1 << 20, flate2::bufread::MultiGzDecoder::new(counted))),
        Compression::Zstd => Box::new(BufReader::with_capacity(1 << 20, Zstd::new(counted).map_err(open_error)?)),
        Compression::Bzip2 => Box::new(BufReader::with_capacity(1 << 20, bzip2::bufread::MultiBzDecoder::new(counted))),
    };
    match format {
        Format::Arrow => {
            arrow_ipc::read_column(&mut reader, &opts.text_field, &mut |_, text| split_long(text, true, opts, emit))
                .map_err(|e| anyhow!("{}: {e:#}", path.display()))
        }
        Format::Jsonl => {
            let mut line = String::new();
            read_lines(path, compression, &mut *reader, &mut |piece| {
                if line.len() + piece.text.len() > MAX_JSON_LINE {
                    bail!(
                        "{}:{}: a JSON line longer than {} MiB, the most this reader holds; cut the document into several lines, or give it as a plain-text file, which is read in parts",
                        path.display(),
                        piece.number,
                        MAX_JSON_LINE >> 20
                    );
                }
                line.push_str(piece.text);
                if !piece.ends {
                    return Ok(());
                }
                if line.trim().is_empty() {
                    line.clear();
                    return Ok(());
                }
                let text = text_of(line.trim_end_matches(['\n', '\r']), &opts.text_field)
                    .map_err(|e| anyhow!("{}:{}: {e}", path.display(), piece.number))?;
                line.clear();
                split_long(&text, true, opts, emit)
            })
        }
        Format::Text => {
            let mut doc = String::new();
            read_lines(path, compression, &mut *reader, &mut |piece| {
                let whole_line = piece.starts && piece.ends;
                if whole_line
                    && opts.separator.as_deref().is_some_and(|s| piece.text.trim_end_matches(['\n', '\r']) == s)
                {
                    if !doc.is_empty() {
                        split_long(&std::mem::take(&mut doc), true, opts, emit)?;
                    }
                } else {
                    doc.push_str(piece.text);
                    if opts.part_bytes.is_some_and(|part| doc.len() >= 2 * part) {
                        // Hand on what is before the last seam; the rest waits for more lines.
                        let cut = seam(&doc, doc.len() - 1);
                        if cut > 0 {
                            let rest = doc.split_off(cut);
                            split_long(&std::mem::replace(&mut doc, rest), false, opts, emit)?;
                        }
                    }
                }
                Ok(())
            })?;
            if !doc.is_empty() {
                split_long(&doc, true, opts, emit)?;
            }
            Ok(())
        }
        Format::Parquet => unreachable!("read above"),
    }
}

fn name(c: Compression) -> &'static str {
    match c {
        Compression::None => "plain",
        Compression::Gzip => "gzip",
        Compression::Zstd => "zstd",
        Compression::Bzip2 => "bzip2",
    }
}

/// A piece of a line: the whole line, or at most [`PART_BYTES`] of it.
struct LinePiece<'a> {
    /// The line's 1-based number.
    number: usize,
    /// The text (the newline included in the line's last piece), whole characters only.
    text: &'a str,
    /// Whether the line starts with this piece.
    starts: bool,
    /// Whether the line ends with this piece.
    ends: bool,
}

/// Calls `piece` with each line in pieces of at most [`PART_BYTES`] (a character cut at a
/// piece's end goes on to the next piece), checking UTF-8: a line is never held whole, however
/// long a decompression bomb makes it.
fn read_lines(
    path: &Path,
    compression: Compression,
    reader: &mut dyn BufRead,
    piece: &mut dyn FnMut(LinePiece) -> Result<()>,
) -> Result<()> {
    // `offset`: the bytes of the current line handed on before `buf`.
    let (mut buf, mut number, mut offset, mut starts) = (Vec::new(), 0usize, 0usize, true);
    loop {
        let (mut ends, mut eof) = (false, false);
        // The lines read whole so far (the current one is not, when a piece of it was handed on).
        let done = number - usize::from(!starts);
        while !ends && buf.len() < PART_BYTES {
            let available = reader.fill_buf().map_err(|e| match compression {
                Compression::None => anyhow!("{}:{}: cannot read: {e}", path.display(), done + 1),
                // Decompression runs ahead of the lines: the damage is somewhere after this one.
                c => anyhow!(
                    "{}: cannot decompress after line {done} ({} data damaged or truncated?): {e}",
                    path.display(),
                    name(c)
                ),
            })?;
            if available.is_empty() {
                eof = true;
                break;
            }
            let room = available.len().min(PART_BYTES - buf.len());
            let n = match available[..room].iter().position(|&b| b == b'\n') {
                Some(i) => {
                    ends = true;
                    i + 1
                }
                None => room,
            };
            buf.extend_from_slice(&available[..n]);
            reader.consume(n);
        }
        if buf.is_empty() {
            return Ok(());
        }
        ends |= eof;
        if starts {
            number += 1;
        }
        let valid = match std::str::from_utf8(&buf) {
            Ok(_) => buf.len(),
            // A character cut at the piece's end: it goes on to the next piece.
            Err(e) if e.error_len().is_none() && !ends => e.valid_up_to(),
            Err(e) => bail!(
                "{}:{number}: not valid UTF-8 (at byte {} of the line)",
                path.display(),
                offset + e.valid_up_to() + 1
            ),
        };
        let text = std::str::from_utf8(&buf[..valid]).expect("checked above");
        piece(LinePiece { number, text, starts, ends })?;
        buf.drain(..valid);
        (offset, starts) = if ends { (0, true) } else { (offset + valid, false) };
    }
}

/// The string in `field` of a JSON object, the other fields skipped unparsed into values.
fn text_of(line: &str, field: &str) -> Result<String> {
    struct Object<'f>(&'f str);
    struct Key<'f>(&'f str);
    impl<'de> DeserializeSeed<'de> for Key<'_> {
        type Value = bool;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
            d.deserialize_str(self)
        }
    }
    impl<'de> Visitor<'de> for Key<'_> {
        type Value = bool;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a key")
        }
        fn visit_str<E>(self, v: &str) -> Result<bool, E> {
            Ok(v == self.0)
        }
    }
    impl<'de> DeserializeSeed<'de> for Object<'_> {
        type Value = Option<Option<String>>;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_map(self)
        }
    }
    impl<'de> Visitor<'de> for Object<'_> {
        type Value = Option<Option<String>>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut found = None;
            while let Some(ours) = map.next_key_seed(Key(self.0))? {
                if ours && found.is_none() {
                    found = Some(map.next_value::<Option<Cow<'de, str>>>()?.map(Cow::into_owned));
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            Ok(found)
        }
    }
    let mut de = serde_json::Deserializer::from_str(line);
    let text = Object(field).deserialize(&mut de)?;
    de.end()?;
    text.flatten().ok_or_else(|| anyhow!("the object has no `{field}` field"))
}

/// Streams column `field` of a Parquet file, one page of values at a time.
fn read_parquet(
    path: &Path,
    file: File,
    opts: &ReadOptions,
    progress: &(dyn Fn(u64) + Sync),
    emit: &mut dyn FnMut(Part) -> Result<()>,
) -> Result<()> {
    use parquet::basic::{ConvertedType, LogicalType, Type as Physical};
    use parquet::column::reader::ColumnReader;
    use parquet::file::reader::{FileReader, SerializedFileReader};

    let field = opts.text_field.as_str();
    let at = |e: &dyn std::fmt::Display| anyhow!("{}: {e}", path.display());
    let reader = SerializedFileReader::new(file).map_err(|e| at(&format_args!("not a Parquet file: {e}")))?;
    let meta = reader.metadata();
    let schema = meta.file_metadata().schema_descr();
    let index = (0..schema.num_columns()).find(|&i| schema.column(i).path().parts() == [field]);
    let Some(index) = index else {
        let names: Vec<String> = schema.root_schema().get_fields().iter().map(|f| f.name().to_owned()).collect();
        return Err(at(&format_args!("no column `{field}` (the columns: {})", names.join(", "))));
    };
    let column = schema.column(index);
    let stringy = matches!(column.logical_type_ref(), None | Some(LogicalType::String))
        && matches!(column.converted_type(), ConvertedType::NONE | ConvertedType::UTF8);
    if column.physical_type() != Physical::BYTE_ARRAY || !stringy {
        let what = column.logical_type_ref().map_or_else(|| column.physical_type().to_string(), |t| format!("{t:?}"));
        return Err(at(&format_args!("column `{field}` holds {what}, not strings")));
    }
    let max_def = column.max_def_level();
    let mut row = 0u64;
    for g in 0..reader.num_row_groups() {
        let group = reader.get_row_group(g).map_err(|e| at(&e))?;
        let ColumnReader::ByteArrayColumnReader(mut values_reader) =
            group.get_column_reader(index).map_err(|e| at(&e))?
        else {
            unreachable!("a BYTE_ARRAY column");
        };
        let (mut defs, mut values) = (Vec::new(), Vec::new());
        loop {
            defs.clear();
            values.clear();
            let (records, _, _) = values_reader
                .read_records(1024, Some(&mut defs), None, &mut values)
                .map_err(|e| at(&format_args!("row {}: {e}", row + 1)))?;
            if records == 0 {
                break;
            }
            let mut values = values.iter();
            for r in 0..records {
                row += 1;
                if max_def > 0 && defs.get(r).is_some_and(|&d| d < max_def) {
                    return Err(at(&format_args!("row {row}: the `{field}` cell is null")));
                }
                let v = values.next().ok_or_else(|| at(&format_args!("row {row}: a value is missing")))?;
                let text =
                    std::str::from_utf8(v.data()).map_err(|_| at(&format_args!("row {row}: not valid UTF-8")))?;
                split_long(text, true, opts, emit)?;
            }
        }
        progress(meta.row_group(g).compressed_size().max(0) as u64);
    }
    Ok(())
}

/// Hands on a document (or a part of one, `last` false), in parts of at most about
/// `part_bytes` cut at seams when the options ask for parts.
fn split_long(text: &str, last: bool, opts: &ReadOptions, emit: &mut dyn FnMut(Part) -> Result<()>) -> Result<()> {
    let mut rest = text;
    if let Some(part) = opts.part_bytes {
        while rest.len() > part {
            let cut = seam(rest, part);
            emit(Part { text: rest[..cut].to_owned(), last: false })?;
            rest = &rest[cut..];
        }
    }
    if !rest.is_empty() || last {
        emit(Part { text: rest.to_owned(), last })?;
    }
    Ok(())
}

/// Where to cut `text` at or before byte `max` (and after `max / 2` where it can) so that the
/// two sides tokenize as the whole does, for tokenizers that split text into words at whitespace
/// first (byte-level BPE: GPT-2, Llama 3, Qwen...): after a single newline between two
/// characters that are not whitespace, else before a single space between two such characters.
/// A text with neither (one enormous word) is cut at a character boundary, and its tokens there
/// may differ. Whether a tokenizer splits so is checked on a probe text before parts are used
/// (`prepare::seams_keep_tokens`).
pub fn seam(text: &str, max: usize) -> usize {
    let b = text.as_bytes();
    let max = max.min(b.len().saturating_sub(1));
    let low = (max / 2).max(1);
    if let Some(i) = (low..=max).rev().find(|&i| newline_seam(b, i)) {
        return i;
    }
    if let Some(i) = (low..=max).rev().find(|&i| space_seam(b, i)) {
        return i;
    }
    let mut cut = max.max(1).min(b.len());
    while cut < b.len() && !text.is_char_boundary(cut) {
        cut -= 1;
    }
    cut
}

/// Whether cutting at `i` is a seam: after a single newline, or before a single space, between
/// two characters that are not whitespace.
pub fn is_seam(text: &str, i: usize) -> bool {
    newline_seam(text.as_bytes(), i) || space_seam(text.as_bytes(), i)
}

fn newline_seam(b: &[u8], i: usize) -> bool {
    i >= 2 && i < b.len() && b[i - 1] == b'\n' && !b[i - 2].is_ascii_whitespace() && !b[i].is_ascii_whitespace()
}

fn space_seam(b: &[u8], i: usize) -> bool {
    i >= 1 && i + 1 < b.len() && b[i] == b' ' && !b[i - 1].is_ascii_whitespace() && !b[i + 1].is_ascii_whitespace()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_say_how_to_read() {
        let k = |n: &str| kind(Path::new(n));
        assert_eq!(k("c4-train.00000-of-01024.json.gz"), (Compression::Gzip, Format::Jsonl));
        assert_eq!(k("00.jsonl.zst"), (Compression::Zstd, Format::Jsonl));
        assert_eq!(k("a.txt.bz2"), (Compression::Bzip2, Format::Text));
        assert_eq!(k("train-00000-of-00002.parquet"), (Compression::None, Format::Parquet));
        assert_eq!(k("data-00000-of-00001.arrow"), (Compression::None, Format::Arrow));
        assert_eq!(k("README"), (Compression::None, Format::Text));
    }

    #[test]
    fn the_text_field_is_found_whatever_else_the_object_holds() {
        let line = r#"{"url": "x", "meta": {"text": 1}, "content": "a\"b", "text": "t"}"#;
        assert_eq!(text_of(line, "content").unwrap(), "a\"b");
        assert_eq!(text_of(line, "text").unwrap(), "t");
        assert!(text_of(line, "body").unwrap_err().to_string().contains("no `body` field"));
        assert!(text_of(r#"{"text": null}"#, "text").is_err());
        let e = text_of(r#"{"text": 5}"#, "text").unwrap_err().to_string();
        assert!(e.contains("invalid type: integer `5`, expected a string"), "{e}");
    }

    /// Reads `name` holding `bytes` as `read_file` does (parts of [`PART_BYTES`]): the parts,
    /// and the bytes read from the file when the first part came.
    fn read_parts(name: &str, bytes: &[u8]) -> Result<(Vec<Part>, u64)> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        let opts = ReadOptions { separator: None, text_field: "text".into(), part_bytes: Some(PART_BYTES) };
        let read = std::sync::atomic::AtomicU64::new(0);
        let progress = |n| {
            read.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        };
        let (mut parts, mut read_at_first) = (Vec::new(), None);
        read_file(&path, &opts, &progress, &mut |part| {
            read_at_first.get_or_insert(read.load(std::sync::atomic::Ordering::Relaxed));
            parts.push(part);
            Ok(())
        })
        .map_err(|e| anyhow!("{}", e.to_string().replace(&path.display().to_string(), name)))?;
        Ok((parts, read_at_first.unwrap_or(0)))
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        use std::io::Write;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(bytes).unwrap();
        gz.finish().unwrap()
    }

    /// A document on one line of 8 MiB (a decompression bomb's shape) was read whole by
    /// `read_until` before its first part was handed on; now its parts go on while it is read,
    /// and come out as the text was.
    #[test]
    fn a_long_line_is_handed_on_while_it_is_read() {
        let text = "word ".repeat(8 << 20 >> 2) + "é".repeat(100_003).as_str();
        let (parts, read_at_first) = read_parts("one-line.txt", text.as_bytes()).unwrap();
        assert!(read_at_first <= 2 << 20, "the first part came after reading {read_at_first} bytes");
        assert!(parts.iter().all(|p| p.text.len() <= PART_BYTES));
        assert!(parts.iter().rev().skip(1).all(|p| !p.last) && parts.last().unwrap().last);
        assert_eq!(parts.iter().map(|p| p.text.as_str()).collect::<String>(), text);
    }

    /// A JSON line is parsed whole, so one longer than [`MAX_JSON_LINE`] (a 457 KB `.gz` that
    /// expanded to a 100 MB line ran out of memory) is refused, naming the line; lines are read
    /// in pieces, so characters cut at a piece's end and a bad byte far into a line are found.
    #[test]
    fn json_lines_are_bounded_and_read_in_pieces() {
        let long = format!("{{\"text\": \"{}\"}}\n", "a".repeat(MAX_JSON_LINE));
        let e = read_parts("bomb.jsonl.gz", &gzip(format!("{{\"text\": \"x\"}}\n{long}").as_bytes()))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("bomb.jsonl.gz:2: a JSON line longer than 32 MiB, the most this reader holds;"), "{e}");
        let text = "xé".repeat(150_001);
        let (parts, _) = read_parts("a.jsonl", format!("\n{{\"text\": \"{text}\"}}\n  \n").as_bytes()).unwrap();
        assert_eq!(parts.iter().map(|p| p.text.as_str()).collect::<String>(), text);
        let mut bad = format!("{{\"text\": \"{text}").into_bytes();
        bad.extend(b"\xff\"}\n");
        let e = read_parts("b.jsonl", &bad).unwrap_err().to_string();
        assert_eq!(e, format!("b.jsonl:1: not valid UTF-8 (at byte {} of the line)", bad.len() - 3));
    }

    /// ruzstd's own text for a frame header it cannot read is Rust's debug output
    /// (`MagicNumberReadError(Error { kind: UnexpectedEof, ... })`).
    #[test]
    fn zstd_errors_are_sentences() {
        let e = read_parts("empty.jsonl.zst", b"").unwrap_err().to_string();
        assert_eq!(
            e,
            "empty.jsonl.zst: not zstd data: the data ends before a zstd frame begins (an empty or truncated file?)"
        );
        let e = read_parts("text.jsonl.zst", b"{\"text\": 1}\n").unwrap_err().to_string();
        assert_eq!(
            e,
            "text.jsonl.zst: not zstd data: a frame begins with 0x6574227b, not zstd's magic number 0xfd2fb528"
        );
    }

    /// `pzstd` writes a skippable frame (its magic, a length, that many bytes) before each
    /// frame; they were refused (`not zstd data: SkipFrame { magic_number: 407710288, ... }`).
    #[test]
    fn skippable_frames_between_frames_are_skipped() {
        let frame = |text: &str| {
            ruzstd::encoding::compress_to_vec(text.as_bytes(), ruzstd::encoding::CompressionLevel::Fastest)
        };
        let skippable =
            |bytes: &[u8]| [&0x184d_2a50u32.to_le_bytes()[..], &(bytes.len() as u32).to_le_bytes(), bytes].concat();
        let one = "{\"text\": \"one\"}\n";
        let two = "{\"text\": \"two\"}\n";
        let pzstd = [skippable(&[9; 4]), frame(one), skippable(&[]), frame(two)].concat();
        let (parts, _) = read_parts("p.jsonl.zst", &pzstd).unwrap();
        assert_eq!(parts.iter().map(|p| p.text.as_str()).collect::<Vec<_>>(), ["one", "two"]);
        let cut = &pzstd[..pzstd.len() - frame(two).len() - 2];
        let e = read_parts("cut.jsonl.zst", cut).unwrap_err().to_string();
        assert!(
            e.ends_with("(zstd data damaged or truncated?): the data ends inside a frame's header (truncated?)"),
            "{e}"
        );
        let e = read_parts("cut.jsonl.zst", &pzstd[..10]).unwrap_err().to_string();
        assert_eq!(e, "cut.jsonl.zst: not zstd data: the data ends inside a skippable frame (truncated?)");
    }

    #[test]
    fn seams_fall_between_words() {
        let text = "alpha beta\ngamma  delta\n\nepsilon";
        for max in 1..text.len() {
            let cut = seam(text, max);
            assert!(cut > 0 && cut <= max.max(1) && text.is_char_boundary(cut), "{max}: {cut}");
        }
        assert_eq!(&text[..seam(text, 17)], "alpha beta\n");
        assert_eq!(&text[..seam(text, 8)], "alpha"); // before the space
        assert_eq!(seam("ééééé", 3), 2);
    }
}
