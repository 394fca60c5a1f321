//! One string column of an Arrow IPC file, streamed: Hugging Face's cache files (`.arrow`, the
//! IPC *stream* format) and IPC *files* (`ARROW1` magic, the same messages framed by a footer).
//!
//! The arrow crates would cost CI minutes of build (arrow-ipc pulls arrow-select and arrow-cmp)
//! for what is a short walk: each message is a FlatBuffer (its schema in the Arrow repository's
//! `format/Message.fbs` and `Schema.fbs`) followed by a body. The schema message gives the
//! columns; every record batch gives, in the schema's depth-first order, one node per field
//! and its buffers, so the column's validity, offsets and data buffers are found by counting the
//! buffers of the fields before it. Only what a text column needs is read: `Utf8` and
//! `LargeUtf8` columns, uncompressed bodies, little-endian. Anything else is refused with a line
//! that says what it found. Batches are read one at a time, so memory holds one batch.

use std::io::Read;

use anyhow::{Result, anyhow, bail};

/// A read-only view of a FlatBuffer table: just the accessors the Arrow messages need.
#[derive(Clone, Copy)]
struct Table<'a> {
    buf: &'a [u8],
    pos: usize,
}

fn u32_at(buf: &[u8], pos: usize) -> Result<u32> {
    let b = buf.get(pos..pos + 4).ok_or_else(|| anyhow!("a message points past its end"))?;
    Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
}

impl<'a> Table<'a> {
    fn root(buf: &'a [u8]) -> Result<Table<'a>> {
        let pos = u32_at(buf, 0)? as usize;
        Table::at(buf, pos)
    }

    fn at(buf: &'a [u8], pos: usize) -> Result<Table<'a>> {
        if pos + 4 > buf.len() {
            bail!("a message points past its end");
        }
        Ok(Table { buf, pos })
    }

    /// Where field `slot` (0, 1, ...) is stored, if present.
    fn field(&self, slot: usize) -> Result<Option<usize>> {
        let soffset = i32::from_le_bytes(self.buf[self.pos..self.pos + 4].try_into().expect("4 bytes"));
        let vtable = (self.pos as i64 - soffset as i64) as usize;
        let b = |at: usize| -> Result<u16> {
            let b = self.buf.get(at..at + 2).ok_or_else(|| anyhow!("a message points past its end"))?;
            Ok(u16::from_le_bytes(b.try_into().expect("2 bytes")))
        };
        let vtable_len = b(vtable)? as usize;
        let entry = 4 + 2 * slot;
        if entry + 2 > vtable_len {
            return Ok(None);
        }
        let offset = b(vtable + entry)? as usize;
        Ok((offset != 0).then_some(self.pos + offset))
    }

    fn scalar<const N: usize>(&self, slot: usize) -> Result<Option<[u8; N]>> {
        match self.field(slot)? {
            None => Ok(None),
            Some(at) => {
                let b = self.buf.get(at..at + N).ok_or_else(|| anyhow!("a message points past its end"))?;
                Ok(Some(b.try_into().expect("N bytes")))
            }
        }
    }

    fn u8(&self, slot: usize) -> Result<u8> {
        Ok(self.scalar::<1>(slot)?.map_or(0, |b| b[0]))
    }

    fn i16(&self, slot: usize) -> Result<i16> {
        Ok(self.scalar::<2>(slot)?.map_or(0, i16::from_le_bytes))
    }

    fn i64(&self, slot: usize) -> Result<i64> {
        Ok(self.scalar::<8>(slot)?.map_or(0, i64::from_le_bytes))
    }

    /// The position after following the offset stored in field `slot`.
    fn indirect(&self, slot: usize) -> Result<Option<usize>> {
        match self.field(slot)? {
            None => Ok(None),
            Some(at) => Ok(Some(at + u32_at(self.buf, at)? as usize)),
        }
    }

    fn table(&self, slot: usize) -> Result<Option<Table<'a>>> {
        self.indirect(slot)?.map(|at| Table::at(self.buf, at)).transpose()
    }

    fn string(&self, slot: usize) -> Result<Option<&'a str>> {
        let Some(at) = self.indirect(slot)? else { return Ok(None) };
        let len = u32_at(self.buf, at)? as usize;
        let b = self.buf.get(at + 4..at + 4 + len).ok_or_else(|| anyhow!("a message points past its end"))?;
        Ok(Some(std::str::from_utf8(b).map_err(|_| anyhow!("a field name is not UTF-8"))?))
    }

    /// A vector of tables.
    fn tables(&self, slot: usize) -> Result<Vec<Table<'a>>> {
        let Some(at) = self.indirect(slot)? else { return Ok(Vec::new()) };
        let len = u32_at(self.buf, at)? as usize;
        (0..len)
            .map(|i| {
                let e = at + 4 + 4 * i;
                Table::at(self.buf, e + u32_at(self.buf, e)? as usize)
            })
            .collect()
    }

    /// A vector of structs of two i64 (FieldNode, Buffer).
    fn pairs(&self, slot: usize) -> Result<Vec<(i64, i64)>> {
        let Some(at) = self.indirect(slot)? else { return Ok(Vec::new()) };
        let len = u32_at(self.buf, at)? as usize;
        let b = self.buf.get(at + 4..at + 4 + 16 * len).ok_or_else(|| anyhow!("a message points past its end"))?;
        Ok(b.chunks_exact(16)
            .map(|c| {
                (i64::from_le_bytes(c[..8].try_into().expect("8")), i64::from_le_bytes(c[8..].try_into().expect("8")))
            })
            .collect())
    }
}

// Message.fbs: Message { version, header_type, header, bodyLength, custom_metadata }.
const HEADER_SCHEMA: u8 = 1;
const HEADER_DICTIONARY: u8 = 2;
const HEADER_RECORD_BATCH: u8 = 3;
// Schema.fbs: the `Type` union's members that matter.
const TYPE_UTF8: u8 = 5;
const TYPE_LARGE_UTF8: u8 = 20;

/// The `Type` union's names, for messages.
fn type_name(t: u8) -> &'static str {
    const NAMES: [&str; 27] = [
        "none",
        "null",
        "int",
        "floating point",
        "binary",
        "utf8",
        "bool",
        "decimal",
        "date",
        "time",
        "timestamp",
        "interval",
        "list",
        "struct",
        "union",
        "fixed-size binary",
        "fixed-size list",
        "map",
        "duration",
        "large binary",
        "large utf8",
        "large list",
        "run-end encoded",
        "binary view",
        "utf8 view",
        "list view",
        "large list view",
    ];
    NAMES.get(t as usize).copied().unwrap_or("unknown")
}

/// How many buffers a field of this type has in a record batch (its children's not counted),
/// from the columnar format's buffer layouts; `None` for layouts whose count varies per batch.
fn own_buffers(field: &Table) -> Result<Option<usize>> {
    if field.table(4)?.is_some() {
        return Ok(Some(2)); // dictionary-encoded: validity and indices
    }
    let t = field.u8(2)?;
    Ok(match t {
        1 => Some(0),                                                                              // null
        2 | 3 | 6..=11 | 15 | 18 => Some(2), // fixed width: validity, values
        4 | 5 | 19 | 20 => Some(3),          // validity, offsets, data
        12 | 17 | 21 => Some(2),             // lists, maps: validity, offsets
        13 | 16 => Some(1),                  // struct, fixed-size list: validity
        14 => Some(if field.table(3)?.map(|u| u.i16(0)).transpose()? == Some(1) { 2 } else { 1 }), // union: dense has offsets
        22 => Some(0),      // run-end encoded: its children hold the data
        25 | 26 => Some(3), // list views: validity, offsets, sizes
        _ => None,          // views (variadic buffers) and the unknown
    })
}

/// Nodes and buffers a field and its descendants take, depth first.
fn span(field: &Table) -> Result<Option<(usize, usize)>> {
    let Some(mut buffers) = own_buffers(field)? else { return Ok(None) };
    let mut nodes = 1;
    for child in field.tables(5)? {
        let Some((n, b)) = span(&child)? else { return Ok(None) };
        nodes += n;
        buffers += b;
    }
    Ok(Some((nodes, buffers)))
}

/// Where the column is in every record batch.
struct Column {
    node: usize,
    buffer: usize,
    large: bool,
}

/// Reads one message: its FlatBuffer metadata and its body. `None` at the end of the stream.
fn next_message(r: &mut dyn Read, first: &mut bool) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
    let mut word = [0u8; 4];
    if !read_full(r, &mut word)? {
        return Ok(None); // a stream without its end marker, as some writers leave it
    }
    if *first && &word == b"ARRO" {
        // The file format: `ARROW1`, two bytes of padding, then the stream.
        let mut rest = [0u8; 4];
        if !read_full(r, &mut rest)? || &rest != b"W1\0\0" {
            bail!("not an Arrow IPC file (no stream or file header)");
        }
        if !read_full(r, &mut word)? {
            return Ok(None);
        }
    }
    *first = false;
    if word == [0xff; 4] && !read_full(r, &mut word)? {
        bail!("the stream ends inside a message header");
    }
    let len = i32::from_le_bytes(word);
    if len == 0 {
        return Ok(None); // the end-of-stream marker
    }
    if !(8..=1 << 28).contains(&len) {
        bail!("not an Arrow IPC stream (a message of {len} bytes)");
    }
    let mut meta = vec![0u8; len as usize];
    if !read_full(r, &mut meta)? {
        bail!("the stream ends inside a message (truncated?)");
    }
    let message = Table::root(&meta)?;
    let body_len = message.i64(3)?;
    if !(0..=1 << 40).contains(&body_len) {
        bail!("a message declares a body of {body_len} bytes");
    }
    let mut body = Vec::new();
    r.take(body_len as u64).read_to_end(&mut body)?;
    if body.len() as i64 != body_len {
        bail!("the stream ends inside a record batch (truncated?)");
    }
    Ok(Some((meta, body)))
}

/// Fills `buf`; false when the reader is at its end before the first byte.
fn read_full(r: &mut dyn Read, buf: &mut [u8]) -> Result<bool> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) if n == 0 => return Ok(false),
            Ok(0) => bail!("the stream ends inside a message (truncated?)"),
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}

/// Streams the strings of column `name`, calling `emit` with each row's 1-based number and text.
/// Errors say what is wrong; the caller names the file.
pub fn read_column(r: &mut dyn Read, name: &str, emit: &mut dyn FnMut(u64, &str) -> Result<()>) -> Result<()> {
    let mut first = true;
    let mut column: Option<Column> = None;
    let mut row = 0u64;
    while let Some((meta, body)) = next_message(r, &mut first)? {
        let message = Table::root(&meta)?;
        let header = message.table(2)?.ok_or_else(|| anyhow!("a message without a header"))?;
        match message.u8(1)? {
            HEADER_SCHEMA => {
                if header.i16(0)? != 0 {
                    bail!("the file is big-endian, which is not supported");
                }
                let fields = header.tables(1)?;
                let (mut node, mut buffer) = (0, 0);
                let mut found = None;
                for f in &fields {
                    if f.string(0)? == Some(name) {
                        let t = f.u8(2)?;
                        if f.table(4)?.is_some() {
                            bail!("column `{name}` is dictionary-encoded, which is not supported");
                        }
                        if t != TYPE_UTF8 && t != TYPE_LARGE_UTF8 {
                            bail!("column `{name}` holds {}, not strings", type_name(t));
                        }
                        found = Some(Column { node, buffer, large: t == TYPE_LARGE_UTF8 });
                        break;
                    }
                    let (n, b) = span(f)?.ok_or_else(|| {
                        anyhow!(
                            "column `{}` before `{name}` has a layout this reader does not support",
                            f.string(0).ok().flatten().unwrap_or("?")
                        )
                    })?;
                    node += n;
                    buffer += b;
                }
                let Some(c) = found else {
                    let names: Vec<&str> = fields.iter().filter_map(|f| f.string(0).ok().flatten()).collect();
                    bail!("no column `{name}` (the columns: {})", names.join(", "));
                };
                column = Some(c);
            }
            HEADER_RECORD_BATCH => {
                let c = column.as_ref().ok_or_else(|| anyhow!("a record batch before the schema"))?;
                if header.table(3)?.is_some() {
                    bail!("the record batches are compressed, which is not supported");
                }
                let nodes = header.pairs(1)?;
                let buffers = header.pairs(2)?;
                let &(length, nulls) = nodes.get(c.node).ok_or_else(|| anyhow!("a record batch lacks the column"))?;
                let bufs =
                    buffers.get(c.buffer..c.buffer + 3).ok_or_else(|| anyhow!("a record batch lacks the column"))?;
                let slice = |(offset, len): (i64, i64)| -> Result<&[u8]> {
                    usize::try_from(offset)
                        .ok()
                        .zip(usize::try_from(len).ok())
                        .and_then(|(o, l)| body.get(o..o.checked_add(l)?))
                        .ok_or_else(|| anyhow!("a buffer lies outside its record batch"))
                };
                let (validity, offsets, data) = (slice(bufs[0])?, slice(bufs[1])?, slice(bufs[2])?);
                let width = if c.large { 8 } else { 4 };
                let length = usize::try_from(length).map_err(|_| anyhow!("a negative row count"))?;
                if offsets.len() < (length + 1) * width || (nulls > 0 && validity.len() * 8 < length) {
                    bail!("a record batch's buffers are shorter than its {length} rows");
                }
                let offset = |i: usize| -> usize {
                    let b = &offsets[i * width..(i + 1) * width];
                    if c.large {
                        i64::from_le_bytes(b.try_into().expect("8")) as usize
                    } else {
                        i32::from_le_bytes(b.try_into().expect("4")) as u32 as usize
                    }
                };
                for i in 0..length {
                    row += 1;
                    if nulls > 0 && validity[i / 8] & (1 << (i % 8)) == 0 {
                        bail!("row {row}: the `{name}` cell is null");
                    }
                    let bytes = data
                        .get(offset(i)..offset(i + 1))
                        .ok_or_else(|| anyhow!("row {row}: offsets outside the data"))?;
                    let text = std::str::from_utf8(bytes).map_err(|_| anyhow!("row {row}: not valid UTF-8"))?;
                    emit(row, text)?;
                }
            }
            HEADER_DICTIONARY => {}
            other => bail!("not an Arrow IPC stream (a message of type {other})"),
        }
    }
    if column.is_none() {
        bail!("not an Arrow IPC stream (no schema)");
    }
    Ok(())
}
