#!/usr/bin/env python3
"""Writes the JPEG fixtures of tests/jpeg_decode.rs: one layout or coding
feature each, on synthetic pictures (gradients, edges, noise), small enough
to keep in the repository. Most through Pillow 11.3's libjpeg; the layouts
libjpeg does not write (4:1:1, 4:4:0, 3:1 sampling, one scan per component,
component ids R G B, Adobe RGB and YCCK) through the small baseline encoder
below (standard quantization table, one Huffman table of fixed-length
codes).

Usage: jpeg_fixtures.py OUT_DIR
"""
import math
import struct
import sys

import numpy as np
from PIL import Image


# ---- A small baseline encoder.

ZZ=[0,1,8,16,9,2,3,10,17,24,32,25,18,11,4,5,12,19,26,33,40,48,41,34,27,20,13,6,7,14,21,28,35,42,49,56,57,50,43,36,29,22,15,23,30,37,44,51,58,59,52,45,38,31,39,46,53,60,61,54,47,55,62,63]
QL=np.array([16,11,10,16,24,40,51,61,12,12,14,19,26,58,60,55,14,13,16,24,40,57,69,56,14,17,22,29,51,87,80,62,18,22,37,56,68,109,103,77,24,35,55,64,81,104,113,92,49,64,78,87,103,121,120,101,72,92,95,98,112,100,103,99]).reshape(8,8)
C=np.array([[ (math.sqrt(1/8) if u==0 else math.sqrt(2/8))*math.cos((2*x+1)*u*math.pi/16) for x in range(8)] for u in range(8)])
AC_SYMS=[0x00,0xF0]+[(r<<4)|s for r in range(16) for s in range(1,11)]
class Bits:
    def __init__(s): s.out=bytearray(); s.acc=0; s.n=0
    def put(s,v,n):
        for i in range(n-1,-1,-1):
            s.acc=(s.acc<<1)|((v>>i)&1); s.n+=1
            if s.n==8:
                s.out.append(s.acc)
                if s.acc==0xFF: s.out.append(0)
                s.acc=0; s.n=0
    def flush(s):
        while s.n: s.put(1,1)
        return bytes(s.out)
def seg(m,body): return bytes([0xFF,m])+struct.pack(">H",len(body)+2)+body
def cat(v):
    v=abs(v); return 0 if v==0 else int(v).bit_length()
def enc_block(b,blk,pred,q):
    coef=C@(blk-128.0)@C.T
    qc=np.round(coef/q).astype(int).reshape(64)
    zz=[qc[ZZ[k]] for k in range(64)]
    d=zz[0]-pred; c=cat(d)
    b.put(c,4)  # DC code: symbol c has 4-bit code c
    if c: b.put(d if d>0 else d+(1<<c)-1, c)
    run=0
    for k in range(1,64):
        v=zz[k]
        if v==0: run+=1; continue
        while run>15: b.put(AC_SYMS.index(0xF0),8); run-=16
        s=cat(v); b.put(AC_SYMS.index((run<<4)|s),8); b.put(v if v>0 else v+(1<<s)-1,s); run=0
    if run: b.put(AC_SYMS.index(0x00),8)
    return zz[0]
def encode(rgb, samp, ids=None, space="ycc", interleave=True, app14=None, jfif=True, quality=1.0, restart=0):
    H,W=rgb.shape[:2]
    x=rgb.astype(np.float64)
    if space=="ycc":
        r,g,bb=x[...,0],x[...,1],x[...,2]
        planes=[0.299*r+0.587*g+0.114*bb, 128-0.168736*r-0.331264*g+0.5*bb, 128+0.5*r-0.418688*g-0.081312*bb]
    elif space=="rgb": planes=[x[...,i] for i in range(3)]
    elif space=="cmyk": planes=[x[...,0],x[...,1],x[...,2],(x[...,0]+x[...,1])/2]
    elif space=="ycck":
        r,g,bb=x[...,0],x[...,1],x[...,2]
        planes=[0.299*r+0.587*g+0.114*bb, 128-0.168736*r-0.331264*g+0.5*bb, 128+0.5*r-0.418688*g-0.081312*bb, 255-(r+g)/2]
    elif space=="gray": planes=[x[...,0]]
    n=len(planes); ids=ids or list(range(1,n+1))
    hmax=max(h for h,v in samp); vmax=max(v for h,v in samp)
    mx=-(-W//(8*hmax)); my=-(-H//(8*vmax))
    comps=[]
    for p,(h,v) in zip(planes,samp):
        fh,fv=hmax//h,vmax//v
        cw=-(-W*h//hmax); ch=-(-H*v//vmax)
        # box downsample with edge replicate
        pw=np.pad(p,((0,ch*fv-H),(0,cw*fh-W)),mode='edge')
        d=pw.reshape(ch,fv,cw,fh).mean(axis=(1,3))
        full=np.pad(d,((0,my*v*8-ch),(0,mx*h*8-cw)),mode='edge')
        comps.append((full,h,v,cw,ch))
    q=np.clip(np.round(QL*quality),1,255)
    out=bytearray(b"\xFF\xD8")
    if jfif: out+=seg(0xE0,b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00")
    if app14 is not None: out+=seg(0xEE,b"Adobe\x00"+bytes([0,100,0,0,0,0,app14]))
    out+=seg(0xDB,bytes([0])+bytes(int(q.reshape(64)[ZZ[k]]) for k in range(64)))
    out+=seg(0xC0,struct.pack(">BHHB",8,H,W,n)+b"".join(bytes([ids[i],(samp[i][0]<<4)|samp[i][1],0]) for i in range(n)))
    dcbits=[0,0,0,12]+[0]*12; out+=seg(0xC4,bytes([0x00])+bytes(dcbits)+bytes(range(12)))
    acbits=[0]*7+[len(AC_SYMS)]+[0]*8; out+=seg(0xC4,bytes([0x10])+bytes(acbits)+bytes(AC_SYMS))
    if restart: out+=seg(0xDD,struct.pack(">H",restart))
    scans=[list(range(n))] if interleave else [[i] for i in range(n)]
    for sc in scans:
        out+=seg(0xDA,bytes([len(sc)])+b"".join(bytes([ids[i],0x00]) for i in sc)+bytes([0,63,0]))
        b=Bits(); preds=[0]*n; units=[]
        if len(sc)==1:
            full,h,v,cw,ch=comps[sc[0]]
            for j in range(-(-ch//8)):
                for i in range(-(-cw//8)): units.append([(sc[0],full[j*8:j*8+8,i*8:i*8+8])])
        else:
            for j in range(my):
                for i in range(mx):
                    u=[]
                    for ci in sc:
                        full,h,v,cw,ch=comps[ci]
                        for y in range(v):
                            for xx in range(h):
                                by,bx=(j*v+y)*8,(i*h+xx)*8
                                u.append((ci,full[by:by+8,bx:bx+8]))
                    units.append(u)
        data=bytearray()
        for k,u in enumerate(units):
            if restart and k and k%restart==0:
                data+=b.flush(); data+=bytes([0xFF,0xD0+((k//restart-1)%8)]); b=Bits(); preds=[0]*n
            for ci,blk in u: preds[ci]=enc_block(b,blk,preds[ci],q)
        data+=b.flush(); out+=data
    out+=b"\xFF\xD9"
    return bytes(out)


def picture(w, h, seed):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack(
        [
            (x * 255 // max(w - 1, 1)),
            (y * 255 // max(h - 1, 1)),
            np.where((x // 6 + y // 5) % 2 == 0, 40, 220),
        ],
        -1,
    ).astype(np.float64)
    a += rng.normal(0, 18, a.shape)
    return Image.fromarray(a.clip(0, 255).astype(np.uint8))


def main(out):
    p = picture(45, 31, 1)
    p.save(f"{out}/b444.jpg", quality=85, subsampling=0)
    p.save(f"{out}/b422.jpg", quality=85, subsampling=1)
    p.save(f"{out}/b420.jpg", quality=85, subsampling=2)
    picture(1, 1, 2).save(f"{out}/tiny_1x1.jpg", quality=90, subsampling=2)
    picture(1, 17, 3).save(f"{out}/tiny_1x17.jpg", quality=90, subsampling=2)
    picture(17, 1, 4).save(f"{out}/tiny_17x1.jpg", quality=90, subsampling=1)
    q = picture(40, 40, 5)
    q.save(f"{out}/q5.jpg", quality=5, subsampling=2)
    q.save(f"{out}/q100.jpg", quality=100, subsampling=0)
    g = picture(61, 47, 6)
    g.save(f"{out}/progressive.jpg", quality=80, progressive=True)
    g.save(f"{out}/progressive_restarts.jpg", quality=80, progressive=True,
           subsampling=1, restart_marker_blocks=5)
    g.save(f"{out}/restarts.jpg", quality=80, restart_marker_blocks=3)
    g.save(f"{out}/optimized.jpg", quality=70, optimize=True)
    g.convert("CMYK").save(f"{out}/cmyk.jpg", quality=85)
    g.convert("L").save(f"{out}/gray_progressive.jpg", quality=85, progressive=True)
    # 16-bit quantization tables (values past 255).
    g.convert("L").save(f"{out}/quant16.jpg",
                        qtables=[[min(300 + 7 * i, 1000) for i in range(64)]])
    rgb = np.asarray(picture(41, 23, 7))
    for name, kw in {
        "sampling_411": dict(samp=[(4, 1), (1, 1), (1, 1)]),
        "sampling_440": dict(samp=[(1, 2), (1, 1), (1, 1)]),
        "sampling_31": dict(samp=[(3, 1), (1, 1), (1, 1)]),
        "sampling_mixed": dict(samp=[(2, 2), (1, 1), (2, 1)]),
        "scan_per_component": dict(samp=[(2, 2), (1, 1), (1, 1)], interleave=False, restart=5),
        "ids_rgb": dict(samp=[(1, 1)] * 3, ids=[82, 71, 66], space="rgb", jfif=False),
        "adobe_rgb": dict(samp=[(1, 1)] * 3, space="rgb", jfif=False, app14=0),
        "adobe_ycck": dict(samp=[(2, 2), (1, 1), (1, 1), (2, 2)], space="ycck", jfif=False, app14=2),
    }.items():
        with open(f"{out}/{name}.jpg", "wb") as f:
            f.write(encode(rgb, **kw))


if __name__ == "__main__":
    main(sys.argv[1])
